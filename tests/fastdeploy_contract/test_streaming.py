"""Routes in FastDeploy 2.6 responses -- streaming, and by reference -- through FastDeploy's code.

The path is FastDeploy's from the captured step to the client's bytes:

* capture: FastDeploy's ``FusedMoE.forward`` and ``post_process_normal`` into our slot cache
  (``test_serving.Instance``);
* the engine's token processor: ``TokenProcessor._process_batch_output_use_zmq``
  (output/token_processor.py:357-449) builds each step's ``RequestOutput`` and, at EOS,
  ``_process_per_token`` calls ``_finalize_routing`` (:340), which is ours;
* the engine-to-API-server transport in its default batch mode (``ZMQ_SEND_BATCH_DATA=1``):
  ``ZmqIpcServer.send_response`` packs the outputs with msgpack (inter_communicator/zmq_server.py:329-371)
  and the API server's ``DealerConnectionManager`` receives them over a real IPC socket and
  hands them to the request (entrypoints/openai/utils.py:218-262);
* the OpenAI layer: ``OpenAIServingChat`` / ``OpenAIServingCompletion`` stream and full
  generators, with FastDeploy's ``TextProcessor`` over a tiny word-level tokenizer built here.

Stood in: the resource manager around the token processor (its ``_recycle_resources`` and
bookkeeping: the scheduler's business) and the engine client's process health and request
semaphore (no engine process runs).  The routes a client reads are compared with the
top-k the MoE layers computed.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import itertools
import json
import os
import pickle
import time
from types import SimpleNamespace

import numpy as np
import pytest

fdctx = pytest.importorskip("fdctx", reason="FastDeploy is not importable (see conftest)")

from test_capture import EOS, UUID  # noqa: E402
from test_serving import Instance, blocks_for  # noqa: E402

from fd_routing_replay import RoutingReader, open_store, routes_from_response  # noqa: E402
from fd_routing_replay.codec.reference import parse_reference  # noqa: E402
from fd_routing_replay.errors import RecordError  # noqa: E402
from fd_routing_replay.integrations.fastdeploy import api as fd_api  # noqa: E402

pytestmark = pytest.mark.skipif(fdctx.GENERATION != fd_api.STEP_BUFFER,
                                reason="routing_store_type 'response' is FastDeploy 2.6's engine-side mode "
                                       "(2.5 refuses it: test_startup)")

ROLLOUT = "exp_4:2:0"
RESPONSE = {"routing_store_type": "response"}
_ports = itertools.count(24701)
_names = itertools.count()


# ---------------------------------------------------------------- FastDeploy's API server parts
@pytest.fixture(scope="module")
def text_processor(tmp_path_factory):
    """FastDeploy's ``TextProcessor`` over a word-level tokenizer built here (``w{id}`` per
    id, ``</s>`` = EOS): FastDeploy's own incremental detokenization, no model download."""
    from fastdeploy.input.text_processor import TextProcessor
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": EOS, "<pad>": 3, "<mask>": 4, "<sep>": 5, "<cls>": 6}
    vocab.update({f"w{i}": i for i in range(7, 1200)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    directory = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>", mask_token="<mask>", sep_token="<sep>",
                            cls_token="<cls>").save_pretrained(str(directory))
    return TextProcessor(model_name_or_path=str(directory))


class EngineClientStandIn:
    """The API server's ``EngineClient`` minus the engine process: the real connection
    manager and data processor; health, weight status and the request semaphore stood in."""

    def __init__(self, connection_manager, data_processor):
        self.connection_manager = connection_manager
        self.data_processor = data_processor
        self.semaphore = SimpleNamespace(release=lambda: None, status=lambda: "stand-in")
        self.ori_vocab_size = 1200
        self.is_master = True

    def check_model_weight_status(self):
        return False

    def check_health(self, time_interval_threashold=None):
        return True, ""

    async def abort(self, *args, **kwargs):
        return None


async def _serve(outputs, request_id, consume):
    """Send the engine's outputs through FastDeploy's batch transport to a consumer
    (``consume(connection_manager)``, an API-server generator) and return what it returns."""
    import zmq
    from fastdeploy import envs
    from fastdeploy.entrypoints.openai.utils import DealerConnectionManager
    from fastdeploy.inter_communicator.zmq_server import ZmqIpcServer

    assert envs.ZMQ_SEND_BATCH_DATA, "FastDeploy's default transport is the batch mode"
    name = f"fdrr{os.getpid()}x{next(_names)}"
    manager = DealerConnectionManager(pid=name)
    await manager.initialize()
    server = ZmqIpcServer(name=name, mode=zmq.PUSH)
    try:
        consumer = asyncio.ensure_future(consume(manager))
        for _ in range(10_000):                       # until the generator registered the request
            if request_id in manager.request_map or consumer.done():
                break
            await asyncio.sleep(0)
        assert request_id in manager.request_map
        for output in outputs:                        # what the engine sends, one step at a time
            server.send_response(None, [[output]], worker_pid=os.getpid())
        return await asyncio.wait_for(consumer, 120)
    finally:
        server.close()
        await manager.close()


def _chunks(lines):
    out = []
    for line in lines:
        payload = line.strip()[len("data:"):].strip()
        if payload != "[DONE]":
            out.append(json.loads(payload))
    return out


def chat_stream(outputs, request_id, text_processor, **request):
    from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest
    from fastdeploy.entrypoints.openai.serving_chat import OpenAIServingChat

    async def consume(manager):
        serving = OpenAIServingChat(EngineClientStandIn(manager, text_processor), None, "fdrr", None, -1, None)
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "w7"}], stream=True, user=ROLLOUT,
                                    **request)
        return [line async for line in serving.chat_completion_stream_generator(
            req, request_id, "tiny", [1000], "w1000", 200)]

    return _chunks(asyncio.run(_serve(outputs, request_id, consume)))


def completion_stream(outputs, request_id, text_processor, **request):
    from fastdeploy.entrypoints.openai.protocol import CompletionRequest
    from fastdeploy.entrypoints.openai.serving_completion import OpenAIServingCompletion

    async def consume(manager):
        serving = OpenAIServingCompletion(EngineClientStandIn(manager, text_processor), None, "fdrr", None, -1)
        req = CompletionRequest(prompt="w1000", stream=True, user=ROLLOUT, **request)
        return [line async for line in serving.completion_stream_generator(
            req, 1, request_id, int(time.time()), "tiny", [[1000]], ["w1000"], [200])]

    return _chunks(asyncio.run(_serve(outputs, request_id, consume)))


def chat_full(outputs, request_id, text_processor):
    from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest
    from fastdeploy.entrypoints.openai.serving_chat import OpenAIServingChat

    async def consume(manager):
        serving = OpenAIServingChat(EngineClientStandIn(manager, text_processor), None, "fdrr", None, -1, None)
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "w7"}], user=ROLLOUT)
        response = await serving.chat_completion_full_generator(req, request_id, "tiny", [1000], "w1000", 200)
        return json.loads(response.model_dump_json())

    return asyncio.run(_serve(outputs, request_id, consume))


def completion_full(outputs, request_id, text_processor):
    from fastdeploy.entrypoints.openai.protocol import CompletionRequest
    from fastdeploy.entrypoints.openai.serving_completion import OpenAIServingCompletion

    async def consume(manager):
        serving = OpenAIServingCompletion(EngineClientStandIn(manager, text_processor), None, "fdrr", None, -1)
        req = CompletionRequest(prompt="w1000", user=ROLLOUT)
        response = await serving.completion_full_generator(req, 1, request_id, int(time.time()), "tiny",
                                                           [[1000]], ["w1000"], [200])
        return json.loads(response.model_dump_json())

    return asyncio.run(_serve(outputs, request_id, consume))


# ---------------------------------------------------------------- the engine: capture + token processor
class ResourceManagerStandIn:
    """What ``_process_batch_output_use_zmq`` reads from the scheduler's resource manager."""

    def __init__(self, task):
        self.stop_flags = [False] * 8
        self.tasks_list = [task] + [None] * 7
        self.to_be_aborted_req_id_set = set()
        self.to_be_rescheduled_request_id_set = set()

    def info(self):
        return "resource manager stand-in"


def make_task(request_id, prompt_len, blocks):
    """A real engine ``Request`` as the scheduler hands it to the token processor."""
    from fastdeploy.engine.request import Request

    now = time.time()
    task = Request.from_dict({
        "request_id": request_id, "prompt_token_ids": list(range(1000, 1000 + prompt_len)),
        "prompt_token_ids_len": prompt_len, "eos_token_ids": [EOS],
        "metrics": {"arrival_time": now, "preprocess_start_time": now, "preprocess_end_time": now,
                    "inference_start_time": now}})
    task.block_tables = list(map(int, blocks))
    return task


def generate(inst, request_id, *, prompt_len=19, new_tokens=6, seed=0):
    """Run one request: each step is captured, then FastDeploy's token processor turns the
    step's sampled token into the ``RequestOutput`` the engine sends.  Returns the outputs,
    the rows the MoE layers computed ``[L, prompt + new - 1, K]`` and the sampled tokens."""
    from fastdeploy.engine.request import RequestStatus

    blocks = blocks_for(np.random.default_rng(seed), 3)
    task = make_task(request_id, prompt_len, blocks)
    task.status = RequestStatus.RUNNING_PREFILL     # as the V1 scheduler hands it over (resource_manager_v1.py:1128)
    inst.task = task
    processor = inst.processor()
    processor.resource_manager = ResourceManagerStandIn(task)
    processor.tokens_counter = collections.defaultdict(int)
    processor.use_logprobs = False
    processor._benchmark_logger = None
    processor._recycle_resources = lambda *args, **kwargs: None      # the scheduler's business
    inst._prompt_len = prompt_len
    steps = [(0, prompt_len)] + [(prompt_len + i, 1) for i in range(new_tokens - 1)]
    sampled = [7 + i for i in range(new_tokens - 1)] + [EOS]
    outputs, rows = [], []
    for i, (start, n) in enumerate(steps):
        last = i == len(steps) - 1
        rows.append(inst.forward(blocks, start, n))
        inst.post_process(last=last)
        inst.capturer.flush_pending_save()
        step = SimpleNamespace(batch_id=0, tokens=np.array([sampled[i]], dtype="int64"), pooler_output=None,
                               logprobs=None, prompt_logprobs=None, sampling_mask=None)
        outputs += processor._process_batch_output_use_zmq([step])
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    return outputs, np.concatenate(rows, axis=1), sampled


def instance(env, monkeypatch, name, **settings):
    for key, value in settings.items():
        monkeypatch.setenv(f"FD_RR_RESPONSE__{key.upper()}", str(value).lower())
    return Instance(env, monkeypatch, name, port=next(_ports), routing=RESPONSE, seed=3)


def last_chunk(chunks):
    finished = [c for c in chunks if c.get("choices") and c["choices"][0].get("finish_reason")]
    assert len(finished) == 1
    return finished[0]


# ---------------------------------------------------------------- streaming
@pytest.mark.parametrize("api", ["chat", "completion"])
def test_a_stream_delivers_the_record_in_its_last_chunk(env, monkeypatch, text_processor, api):
    inst = instance(env, monkeypatch, "s", stream=True)
    prefix = "chatcmpl" if api == "chat" else "cmpl"
    request_id = f"{prefix}-{ROLLOUT}-{UUID}"
    try:
        outputs, rows, sampled = generate(inst, f"{request_id}_0")
        stream = chat_stream if api == "chat" else completion_stream
        chunks = stream(outputs, request_id, text_processor, collect_metrics=True)
        final = last_chunk(chunks)
        text = "".join((c["choices"][0].get("delta") or {}).get("content") or c["choices"][0].get("text") or ""
                       for c in chunks if c.get("choices"))
        assert text == text_processor.tokenizer.decode(sampled[:-1])     # FastDeploy detokenized the stream
        # only the last chunk carries routes: earlier chunks' metrics have none
        assert all("routed_experts" not in (c.get("metrics") or {}) for c in chunks if c is not final)
        record = routes_from_response(final)
        assert record.rollout_id == ROLLOUT
        np.testing.assert_array_equal(record.ids, rows)
        assert record.ids.shape[1] == 19 + len(sampled) - 1
        record.check_tokens(list(range(1000, 1019)) + sampled)
    finally:
        inst.close()


def test_without_collect_metrics_a_stream_has_no_routes_and_says_why(env, monkeypatch, text_processor):
    inst = instance(env, monkeypatch, "n", stream=True)
    request_id = f"chatcmpl-{ROLLOUT}-{UUID}"
    try:
        outputs, _, _ = generate(inst, f"{request_id}_0")
        final = last_chunk(chat_stream(outputs, request_id, text_processor))
        assert "metrics" not in final
        with pytest.raises(RecordError, match="collect_metrics"):
            routes_from_response(final)
    finally:
        inst.close()


def test_streaming_is_off_by_default(env, monkeypatch, text_processor):
    inst = instance(env, monkeypatch, "o")
    request_id = f"chatcmpl-{ROLLOUT}-{UUID}"
    try:
        outputs, rows, _ = generate(inst, f"{request_id}_0")
        final = last_chunk(chat_stream(outputs, request_id, text_processor, collect_metrics=True))
        assert "routed_experts" not in final["metrics"]
        # the non-streaming response still carries them (what FastDeploy does itself)
        np.testing.assert_array_equal(routes_from_response(chat_full(outputs, request_id, text_processor)).ids,
                                      rows)
    finally:
        inst.close()


# ---------------------------------------------------------------- non-streaming, FastDeploy's transport
@pytest.mark.parametrize("api", ["chat", "completion"])
def test_the_non_streaming_record_survives_fastdeploys_default_transport(env, monkeypatch, text_processor, api):
    """msgpack turns a numpy array into a list of ints, which the OpenAI layer makes int64
    (zmq_server.py:34-47, serving_chat.py:730-733): the engine side hands over bytes."""
    inst = instance(env, monkeypatch, "f")
    prefix = "chatcmpl" if api == "chat" else "cmpl"
    request_id = f"{prefix}-{ROLLOUT}-{UUID}"
    try:
        outputs, rows, _ = generate(inst, f"{request_id}_0")
        response = (chat_full if api == "chat" else completion_full)(outputs, request_id, text_processor)
        raw = base64.b64decode(response["routed_experts"])
        sent = bytes(outputs[-1].routing_data)
        assert len(raw) == len(sent) and raw == sent             # byte for byte, not widened to int64
        assert isinstance(outputs[-1].routing_data, bytes)
        np.testing.assert_array_equal(routes_from_response(response).ids, rows)
    finally:
        inst.close()


# ---------------------------------------------------------------- by reference
def test_a_reference_response_resolves_to_the_stored_record(env, monkeypatch, text_processor):
    inst = instance(env, monkeypatch, "r", routes="reference", stream=True)
    request_id = f"chatcmpl-{ROLLOUT}-{UUID}"
    try:
        outputs, rows, _ = generate(inst, f"{request_id}_0")
        response = chat_full(outputs, request_id, text_processor)
        ref = parse_reference(base64.b64decode(response["routed_experts"]))
        assert ref.key == ROLLOUT and ref.namespace == inst.engine.config.store.namespace
        assert ref.size == rows.size * 2 and ref.shape == rows.shape and ref.dtype == "uint16"
        assert len(response["routed_experts"]) < 600                      # not the record
        # streamed too: the same reference in the last chunk
        final = last_chunk(chat_stream(outputs, request_id, text_processor, collect_metrics=True))
        assert final["metrics"]["routed_experts"] == response["routed_experts"]
        with RoutingReader(open_store(f"local://{inst.store_root}")) as reader:
            np.testing.assert_array_equal(routes_from_response(response, reader, timeout=60).ids, rows)
            np.testing.assert_array_equal(reader.resolve(ref, timeout=60).ids, rows)
            # another version stored under the key: refused, expected and actual named
            assert inst.engine.flush(60)
            other = reader.get(ROLLOUT)
            reader.store.put(ROLLOUT, _encoded_with_ids(other, np.roll(other.ids, 1, axis=1)))
            with pytest.raises(RecordError, match=f"checksum [0-9a-f]{{16}} \\(expected {ref.checksum:016x}\\)"):
                reader.resolve(ref, timeout=0)
            reader.store.delete([ROLLOUT])
            with pytest.raises(RecordError, match=f"record {ROLLOUT!r}.*no record is stored under it"):
                reader.resolve(ref, timeout=0)
        stats = inst.engine.stats()
        assert stats["references_returned"] == 1 and stats["records_returned"] == 1
    finally:
        inst.close()


def _encoded_with_ids(record, ids):
    from fd_routing_replay.codec import RoutingRecord, encode_record

    return encode_record(RoutingRecord(record.rollout_id, np.ascontiguousarray(ids), record.num_experts,
                                       record.fill_value, {}))


def test_outputs_with_streamed_routes_still_pickle(env, monkeypatch):
    """FastDeploy's splitwise scheduler pickles outputs (scheduler/splitwise_scheduler.py:901)."""
    inst = instance(env, monkeypatch, "p", stream=True)
    try:
        outputs, _, _ = generate(inst, f"chatcmpl-{ROLLOUT}-{UUID}_0")
        final = outputs[-1]
        copy = pickle.loads(pickle.dumps(final, protocol=5))
        assert type(copy.metrics) is type(final.metrics)
        assert copy.metrics.routed_experts == final.metrics.routed_experts
        assert copy.to_dict()["metrics"]["routed_experts"] == base64.b64encode(final.routing_data).decode()
        assert copy.metrics.first_token_time == final.metrics.first_token_time   # FastDeploy's fields kept
    finally:
        inst.close()


# ---------------------------------------------------------------- a FastDeploy 2.6 finding (docs/fastdeploy.md)
def test_fastdeploys_zmq_output_path_never_makes_a_request_preemptable(env, monkeypatch):
    """FD_USE_GET_SAVE_OUTPUT_V1=1: ``_process_batch_output_use_zmq`` never moves a request to
    RUNNING_DECODE (only ``_process_batch_output`` does, token_processor.py:1018-1019), and
    the V1 scheduler preempts only RUNNING_DECODE requests (resource_manager_v1.py:355-372):
    when KV blocks run out it finds no candidate and logs "scheduler may be hung" (:386-393).
    The live rig (tests/live) therefore runs preemption on FastDeploy's default output path."""
    from fastdeploy.engine.request import RequestStatus
    from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

    inst = instance(env, monkeypatch, "z")
    try:
        outputs, _, _ = generate(inst, f"chatcmpl-{ROLLOUT}-{UUID}_0")
    finally:
        inst.close()
    assert len(outputs) > 1                                 # the request decoded several tokens
    assert inst.task.status == RequestStatus.RUNNING_PREFILL
    candidate, _ = ResourceManagerV1._select_preempt_candidate(SimpleNamespace(running=[inst.task]))
    assert candidate is None
    inst.task.status = RequestStatus.RUNNING_DECODE         # what the default output path sets
    candidate, _ = ResourceManagerV1._select_preempt_candidate(SimpleNamespace(running=[inst.task]))
    assert candidate is inst.task
