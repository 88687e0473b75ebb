"""The live rig's process start-up hook (test tree only; on ``PYTHONPATH`` in the rig's processes).

Every process of the rig -- the API server and engine, the ``paddle.distributed.launch``
launcher, the worker, the plugin's writer -- starts Python with this directory on
``PYTHONPATH``; when ``FDRR_LIVE_RIG=1`` the CPU stand-ins for FastDeploy's compiled
kernels go in place before anything imports FastDeploy (``tests/fdcpu``), and with
``FDRR_LIVE_PLANT_FILE`` the switchable planted bugs of ``tests/live/plants.py``.  Without
``FDRR_LIVE_RIG`` it does nothing.
"""

import os

if os.environ.get("FDRR_LIVE_RIG") == "1":
    from tests.fdcpu import install

    install()
    if os.environ.get("FDRR_LIVE_PLANT_FILE"):         # planted bugs, off until the file names one
        from tests.live import plants

        plants.install()
    if os.environ.get("FDRR_LIVE_HANG") == "worker":   # a worker that never finishes loading
        from tests.live import plants

        plants.install_hang()
