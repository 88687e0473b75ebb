// The table-API manager's per-step host bookkeeping in one bound object (no Paddle op
// dispatch, no per-step allocation, no per-sequence Python).
//
// fd_routing_replay.capture.fd25 drives it (the manager's only per-step path); the NumPy
// model in tests/capture/step_oracle.py is the reference it is tested against.  Per step:
//
//   Plan     positions, step-buffer rows and KV slots of every tracked token, and the
//            slots that forwarded (get_token_positions + compute_slot_mapping);
//   Commit   after the step's rows reached the host staging: which tokens have no valid
//            KV slot (their requests are marked damaged), how many of each slot's tokens
//            count (speculative decoding: a decode step keeps its accepted tokens,
//            accept_num clamped to [1, count]), each slot's forwarded length, the device
//            counters' deltas, and the scatter of the kept rows into the host slot cache --
//            the rows of a layer that recorded nothing this step as the fill: they are
//            stale (update_host_cache);
//   Finished which forwarding slots finished (EOS, stop flag; with speculation also the
//            length limit reached by the kept tokens; an unfinished prefill chunk cannot
//            end a request), and each one's length: its forwarded positions, with
//            speculation cut after the first EOS among the kept tokens and at the length
//            limit (put_finished_batch's check).
//
// Arrays are numpy arrays handed over once at construction (the object keeps them alive);
// per-step inputs are raw host addresses of integer buffers with their item size, so a
// CPU Paddle tensor is read in place.
//
// Also here, over host arrays only: StepFlush (FastDeploy 2.6's worker flush) and
// pack_request (a finished request's rows, packed straight into the writer's ring).  Every
// argument is checked once, at the entry point, by bound_args.h.

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "bound_args.h"

namespace py = pybind11;

namespace {

using fdrr::Array;
using fdrr::Describe;
using fdrr::Refuse;

int64_t ReadInt(const void* base, int64_t itemsize, int64_t i) {
  switch (itemsize) {
    case 1:
      return static_cast<const int8_t*>(base)[i];
    case 2:
      return static_cast<const int16_t*>(base)[i];
    case 4:
      return static_cast<const int32_t*>(base)[i];
    default:
      return static_cast<const int64_t*>(base)[i];
  }
}

void CheckItemsize(int64_t itemsize, const char* what) {
  if (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8) {
    Refuse(std::string(what) + " has item size " + std::to_string(itemsize) + "; 1, 2, 4 or 8 bytes expected");
  }
}

// An int64 [1 + L] counter array of the same length as `counters`, refused naming `name`.
void CheckCounterLength(const py::array& counters, const py::array& other, const char* name) {
  if (other.shape(0) != counters.shape(0)) {
    Refuse(std::string(name) + " must be int64 [" + std::to_string(counters.shape(0)) +
           "] like host_counters, got " + Describe(other));
  }
}

// The host slot cache [S, ...] and the staging [T, ...] scattered into it: C-contiguous
// routing arrays of one dtype with rows of one size, the cache writeable.
void CheckCacheAndStaging(const py::array& cache, const py::array& staging) {
  if (cache.shape(0) == 0) Refuse("cache must have at least one slot, got " + Describe(cache));
  if (staging.shape(0) == 0) Refuse("staging must have at least one row, got " + Describe(staging));
  if (staging.itemsize() != cache.itemsize()) {
    Refuse("staging must have the cache's dtype, got " + Describe(staging) + " for " + Describe(cache));
  }
}

// The host slot cache and the staging rows scattered into it, checked and bound once (the
// arrays keep the memory behind the raw pointers alive).
class ScatterTarget {
 protected:
  void BindTarget(const py::object& cache, const py::object& staging) {
    cache_ = Array(cache, "cache", 'u', fdrr::kBytes1 | fdrr::kBytes2 | fdrr::kBytes4, -1, true);
    staging_ = Array(staging, "staging", 'u', fdrr::kBytes1 | fdrr::kBytes2 | fdrr::kBytes4, cache_.ndim(),
                     false);
    CheckCacheAndStaging(cache_, staging_);
    row_bytes_ = cache_.nbytes() / cache_.shape(0);
    if (staging_.nbytes() / staging_.shape(0) != row_bytes_) {
      Refuse("staging rows must have the cache's row size, got " + Describe(staging) + " for " + Describe(cache));
    }
    cache_ptr_ = static_cast<unsigned char*>(cache_.mutable_data());
    staging_ptr_ = static_cast<const unsigned char*>(staging_.data());
    cache_rows_ = cache_.shape(0);
    staging_rows_ = staging_.shape(0);
  }

  py::array cache_, staging_;
  unsigned char* cache_ptr_ = nullptr;
  const unsigned char* staging_ptr_ = nullptr;
  int64_t row_bytes_ = 0, cache_rows_ = 0, staging_rows_ = 0;
};

class StepLedger : private ScatterTarget {
 public:
  StepLedger(const py::object& registered, const py::object& forwarded, const py::object& damaged,
             const py::object& tokens, const py::object& slots, const py::object& finished,
             const py::object& block_table, int64_t block_size, int64_t max_model_len,
             const py::object& cache, const py::object& staging, const py::object& host_counters,
             const py::object& seen, const py::object& delta)
      : registered_(Array(registered, "registered", 'b', fdrr::kBytes1, 1, false)),
        forwarded_(Array(forwarded, "forwarded", 'i', fdrr::kBytes8, 1, true)),
        damaged_(Array(damaged, "damaged", 'b', fdrr::kBytes1, 1, true)),
        tokens_(Array(tokens, "tokens", 'i', fdrr::kBytes8, 2, true)),
        slots_(Array(slots, "slots", 'i', fdrr::kBytes8, 2, true)),
        finished_(Array(finished, "finished", 'i', fdrr::kBytes8, 2, true)),
        block_size_(block_size),
        max_model_len_(max_model_len) {
    num_seqs_ = registered_.shape(0);
    const std::string s = std::to_string(num_seqs_);
    if (forwarded_.shape(0) != num_seqs_) Refuse("forwarded must be int64 [" + s + "] like registered, got " + Describe(forwarded));
    if (damaged_.shape(0) != num_seqs_) Refuse("damaged must be bool [" + s + "] like registered, got " + Describe(damaged));
    if (slots_.shape(0) != 5 || slots_.shape(1) != num_seqs_) Refuse("slots must be int64 [5, " + s + "], got " + Describe(slots));
    if (finished_.shape(0) != 2 || finished_.shape(1) != num_seqs_) {
      Refuse("finished must be int64 [2, " + s + "], got " + Describe(finished));
    }
    if (tokens_.shape(0) != 4) Refuse("tokens must be int64 [4, T], got " + Describe(tokens));
    if (block_size_ <= 0) Refuse("block_size must be positive, got " + std::to_string(block_size_));
    if (max_model_len_ <= 0) Refuse("max_model_len must be positive, got " + std::to_string(max_model_len_));
    capacity_ = tokens_.shape(1);
    if (!block_table.is_none()) {
      table_ = Array(block_table, "block_table", 'i', fdrr::kBytes4 | fdrr::kBytes8, 2, false);
      table_ptr_ = table_.data();
      table_isz_ = table_.itemsize();
      table_rows_ = table_.shape(0);
      table_width_ = table_.shape(1);
    }
    if (!cache.is_none()) {
      BindTarget(cache, staging);
      counters_ = Array(host_counters, "host_counters", 'i', fdrr::kBytes8, 1, false);
      seen_ = Array(seen, "seen", 'i', fdrr::kBytes8, 1, true);
      delta_ = Array(delta, "delta", 'i', fdrr::kBytes8, 1, true);
      if (counters_.shape(0) < 2 || (staging_.ndim() == 3 && counters_.shape(0) != staging_.shape(1) + 1)) {
        Refuse("host_counters must be int64 [1 + L] for the staging's L layers, got " + Describe(host_counters) +
               " for " + Describe(staging));
      }
      CheckCounterLength(counters_, seen_, "seen");
      CheckCounterLength(counters_, delta_, "delta");
      counters_ptr_ = static_cast<const int64_t*>(counters_.data());
      seen_ptr_ = static_cast<int64_t*>(seen_.mutable_data());
      delta_ptr_ = static_cast<int64_t*>(delta_.mutable_data());
      counters_len_ = counters_.shape(0);
    }
  }

  // Returns (tokens, active_slots, step_tokens); tokens = -1 when the tracked tokens do not
  // fit the scratch (the caller takes its general path for this step).
  py::tuple Plan(uintptr_t decoder, int64_t decoder_itemsize, int64_t decoder_len, uintptr_t this_time,
                 int64_t this_time_itemsize, int64_t n, uintptr_t encoder, int64_t encoder_itemsize,
                 int64_t encoder_len) {
    CheckItemsize(decoder_itemsize, "seq_lens_decoder");
    CheckItemsize(this_time_itemsize, "seq_lens_this_time");
    if (n > num_seqs_) {
      Refuse(std::to_string(n) + " slots in seq_lens_this_time; the manager tracks " + std::to_string(num_seqs_));
    }
    if (decoder_len < n) {
      Refuse("seq_lens_decoder has " + std::to_string(decoder_len) + " entries but seq_lens_this_time has " +
             std::to_string(n) + "; both must cover every running slot");
    }
    if (encoder != 0) CheckItemsize(encoder_itemsize, "seq_lens_encoder");
    const void* dec = reinterpret_cast<const void*>(decoder);
    const void* cnt = reinterpret_cast<const void*>(this_time);
    const void* enc = reinterpret_cast<const void*>(encoder);
    const auto* reg = static_cast<const uint8_t*>(registered_.data());
    auto* tok = static_cast<int64_t*>(tokens_.mutable_data());
    int64_t* tb = tok;
    int64_t* tp = tok + capacity_;
    int64_t* tr = tok + 2 * capacity_;
    int64_t* ts = tok + 3 * capacity_;
    auto* sl = static_cast<int64_t*>(slots_.mutable_data());
    int64_t* sa = sl;
    int64_t* ss = sl + num_seqs_;
    int64_t* sc = sl + 2 * num_seqs_;
    int64_t* sp = sl + 3 * num_seqs_;
    int64_t* sk = sl + 4 * num_seqs_;
    const void* table = table_ptr_;
    const int64_t table_isz = table_isz_;
    int64_t row = 0, out = 0, a = 0;
    for (int64_t b = 0; b < n; ++b) {
      int64_t count = ReadInt(cnt, this_time_itemsize, b);
      if (count <= 0) continue;
      if (!reg[b]) {
        row += count;
        continue;
      }
      if (out + count > capacity_) {
        return py::make_tuple(-1, 0, 0);
      }
      const int64_t start = ReadInt(dec, decoder_itemsize, b);
      sa[a] = b;
      ss[a] = start;
      sc[a] = count;
      sp[a] = (enc != nullptr && b < encoder_len) ? (ReadInt(enc, encoder_itemsize, b) > 0) : 0;
      sk[a] = count;
      ++a;
      for (int64_t j = 0; j < count; ++j, ++row, ++out) {
        const int64_t p = start + j;
        int64_t slot = -1;
        if (table != nullptr && p >= 0 && b < table_rows_ && p / block_size_ < table_width_) {
          const int64_t blk = ReadInt(table, table_isz, b * table_width_ + p / block_size_);
          if (blk >= 0) slot = blk * block_size_ + p % block_size_;
        }
        tb[out] = b;
        tp[out] = p;
        tr[out] = row;
        ts[out] = slot;
      }
    }
    return py::make_tuple(out, a, row);
  }

  // After the step's rows reached the staging (`staged_rows` of them; -1: no offload on
  // this rank).  `accept` (0: no speculative decoding) is FastDeploy's accept_num per slot:
  // a decode step keeps that many of its tokens (clamped to [1, count]), a prefill step all.
  // Returns (written, unmapped, missing_layers, bad_ids).
  py::tuple Commit(int64_t tokens, int64_t active, int64_t staged_rows, uintptr_t accept,
                   int64_t accept_itemsize, int64_t accept_len) {
    if (accept != 0) CheckItemsize(accept_itemsize, "accept_num");
    const auto* tok = static_cast<const int64_t*>(tokens_.data());
    const int64_t* tb = tok;
    const int64_t* tp = tok + capacity_;
    const int64_t* tr = tok + 2 * capacity_;
    const int64_t* ts = tok + 3 * capacity_;
    auto* sl = static_cast<int64_t*>(slots_.mutable_data());
    const int64_t* sa = sl;
    const int64_t* ss = sl + num_seqs_;
    const int64_t* sc = sl + 2 * num_seqs_;
    const int64_t* sp = sl + 3 * num_seqs_;
    int64_t* sk = sl + 4 * num_seqs_;
    auto* dmg = static_cast<uint8_t*>(damaged_.mutable_data());
    auto* fwd = static_cast<int64_t*>(forwarded_.mutable_data());
    const void* acc = reinterpret_cast<const void*>(accept);
    int64_t unmapped = 0;
    for (int64_t i = 0; i < tokens; ++i) {
      if (ts[i] < 0 || tp[i] >= max_model_len_) {
        ++unmapped;
        dmg[tb[i]] = 1;
      }
    }
    for (int64_t a = 0; a < active; ++a) {
      int64_t kept = sc[a];
      if (acc != nullptr && !sp[a] && sa[a] < accept_len) {
        kept = std::min(std::max<int64_t>(ReadInt(acc, accept_itemsize, sa[a]), 1), sc[a]);
      }
      sk[a] = kept;
      fwd[sa[a]] = ss[a] + kept;
    }
    if (staged_rows < 0 || cache_ptr_ == nullptr) return py::make_tuple(0, unmapped, 0, 0);
    const int64_t* hc = counters_ptr_;
    int64_t* seen = seen_ptr_;
    int64_t* delta = delta_ptr_;
    const int64_t width = counters_len_;
    int64_t missing = 0;
    for (int64_t l = 0; l < width; ++l) {
      delta[l] = hc[l] - seen[l];
      seen[l] = hc[l];
      if (l > 0 && delta[l] == 0) ++missing;
    }
    const int64_t bad = delta[0];
    if (tokens == 0) return py::make_tuple(0, unmapped, missing, bad);
    // A layer that recorded nothing this step left the previous step's rows in the staging:
    // its rows of the step's tokens are written as the fill (all bits set), the others kept.
    const int64_t layers = width - 1, layer_bytes = layers > 0 ? row_bytes_ / layers : 0;
    unsigned char* dst = cache_ptr_;
    const unsigned char* src = staging_ptr_;
    const int64_t rows_here = staged_rows < staging_rows_ ? staged_rows : staging_rows_;
    int64_t written = 0;
    int64_t i = 0;
    for (int64_t a = 0; a < active; ++a) {       // the tokens of each active slot, in order
      for (int64_t j = 0; j < sc[a]; ++j, ++i) {
        const int64_t r = tr[i];
        if (r >= rows_here) {            // more tokens than the step buffer holds
          dmg[tb[i]] = 1;
          continue;
        }
        const int64_t s = ts[i];
        if (j >= sk[a] || s < 0 || tp[i] >= max_model_len_ || s >= cache_rows_ || r < 0) continue;
        unsigned char* row = dst + s * row_bytes_;
        std::memcpy(row, src + r * row_bytes_, static_cast<size_t>(row_bytes_));
        if (missing > 0) {
          for (int64_t l = 0; l < layers; ++l) {
            if (delta[l + 1] == 0) std::memset(row + l * layer_bytes, 0xFF, static_cast<size_t>(layer_bytes));
          }
        } else {
          ++written;
        }
      }
    }
    return py::make_tuple(written, unmapped, missing, bad);
  }

  // Slots among the step's `active` ones that finished: flagged in `finished` or
  // `stop_flags` (any nonzero value), registered, and past their prompt (`prompt_lens`, when
  // given).  With speculation (`step_idx` and `max_dec_len` given) a decode step also ends a
  // request whose kept tokens reach its length limit.  Writes each finished slot to row 0 of
  // the finished scratch and its length to row 1: the forwarded positions, with speculation
  // cut after the first EOS among the kept accepted tokens (`accept_tokens` [S, width],
  // `eos`) and at the length limit (at least 1).  Returns how many.
  int64_t Finished(int64_t active, uintptr_t finished, int64_t finished_itemsize, int64_t finished_len,
                   uintptr_t stop, int64_t stop_itemsize, int64_t stop_len, uintptr_t prompt,
                   int64_t prompt_itemsize, int64_t prompt_len, uintptr_t step_idx, int64_t step_idx_itemsize,
                   int64_t step_idx_len, uintptr_t max_dec, int64_t max_dec_itemsize, int64_t max_dec_len,
                   uintptr_t accept_tokens, int64_t accept_tokens_itemsize, int64_t accept_tokens_len,
                   uintptr_t eos, int64_t eos_itemsize, int64_t eos_len) {
    if (finished != 0) CheckItemsize(finished_itemsize, "finished_batch_ids");
    if (stop != 0) CheckItemsize(stop_itemsize, "stop_flags");
    if (prompt != 0) CheckItemsize(prompt_itemsize, "prompt_lens");
    if (step_idx != 0) CheckItemsize(step_idx_itemsize, "step_idx");
    if (max_dec != 0) CheckItemsize(max_dec_itemsize, "max_dec_len");
    if (accept_tokens != 0) CheckItemsize(accept_tokens_itemsize, "accept_tokens");
    if (eos != 0) CheckItemsize(eos_itemsize, "eos_token_id");
    const auto* sl = static_cast<const int64_t*>(slots_.data());
    const int64_t* sa = sl;
    const int64_t* ss = sl + num_seqs_;
    const int64_t* sc = sl + 2 * num_seqs_;
    const int64_t* sp = sl + 3 * num_seqs_;
    const int64_t* sk = sl + 4 * num_seqs_;
    const auto* reg = static_cast<const uint8_t*>(registered_.data());
    const auto* fwd = static_cast<const int64_t*>(forwarded_.data());
    auto* outp = static_cast<int64_t*>(finished_.mutable_data());
    int64_t* lengths = outp + num_seqs_;
    const void* fin = reinterpret_cast<const void*>(finished);
    const void* stp = reinterpret_cast<const void*>(stop);
    const void* pr = reinterpret_cast<const void*>(prompt);
    const void* sidx = reinterpret_cast<const void*>(step_idx);
    const void* mdec = reinterpret_cast<const void*>(max_dec);
    const void* acc = reinterpret_cast<const void*>(accept_tokens);
    const void* eo = reinterpret_cast<const void*>(eos);
    const bool limits = sidx != nullptr && mdec != nullptr;
    const bool eos_cut = acc != nullptr && eo != nullptr;
    const int64_t width = eos_cut && num_seqs_ > 0 ? accept_tokens_len / num_seqs_ : 0;
    int64_t k = 0;
    for (int64_t a = 0; a < active; ++a) {
      const int64_t b = sa[a];
      const bool decode = !sp[a];
      bool bounded = false;
      int64_t remaining = 0;
      if (limits && b < step_idx_len && b < max_dec_len) {
        bounded = true;
        remaining = ReadInt(mdec, max_dec_itemsize, b) - ReadInt(sidx, step_idx_itemsize, b);
      }
      const bool flagged = (fin != nullptr && b < finished_len && ReadInt(fin, finished_itemsize, b) != 0) ||
                           (stp != nullptr && b < stop_len && ReadInt(stp, stop_itemsize, b) != 0) ||
                           (bounded && decode && sk[a] >= remaining);
      if (!flagged || !reg[b]) continue;
      if (pr != nullptr && b < prompt_len && ss[a] + sc[a] < ReadInt(pr, prompt_itemsize, b)) {
        continue;                      // an unfinished prefill chunk cannot end the request
      }
      int64_t length = fwd[b];
      if (decode && (limits || eos_cut)) {   // speculative decoding: the kept tokens, cut
        int64_t kept = sk[a];
        if (eos_cut) {
          for (int64_t j = 0; j < std::min(kept, width); ++j) {
            const int64_t token = ReadInt(acc, accept_tokens_itemsize, b * width + j);
            bool is_eos = false;
            for (int64_t e = 0; e < eos_len && !is_eos; ++e) is_eos = ReadInt(eo, eos_itemsize, e) == token;
            if (is_eos) {
              kept = j + 1;
              break;
            }
          }
        }
        if (bounded) kept = std::min(kept, std::max<int64_t>(remaining, 1));
        length = ss[a] + kept;
      }
      outp[k] = b;
      lengths[k] = length;
      ++k;
    }
    return k;
  }

  int64_t capacity() const { return capacity_; }

 private:
  py::array registered_, forwarded_, damaged_, tokens_, slots_, finished_;
  // references that keep the arrays behind the raw pointers alive
  py::array table_, counters_, seen_, delta_;
  const void* table_ptr_ = nullptr;
  int64_t table_isz_ = 0;
  const int64_t* counters_ptr_ = nullptr;
  int64_t* seen_ptr_ = nullptr;
  int64_t* delta_ptr_ = nullptr;
  int64_t counters_len_ = 0;
  int64_t block_size_, max_model_len_;
  int64_t num_seqs_ = 0, capacity_ = 0, table_rows_ = 0, table_width_ = 0;
};

// FastDeploy 2.6's flush (the worker capturer), bound once over its arrays: the step's
// staged rows [T, L, K] into the host slot cache at the KV slots FastDeploy gave (staged in
// `extra`, any integer item size), after the device counters' deltas.  `columns` (int64 [L],
// or None for the identity) is the cache row of each of our L layers when the cache is laid
// out with more rows (FastDeploy's view counts leading dense layers: [S, R, K], R >= L).  The
// rows of a layer that recorded nothing this step are stale: that layer's rows are written
// as the fill (all bits set), the others as staged; a damaged step (a hook failed) writes
// the fill for every layer.  Slots outside the cache are skipped and counted.
class StepFlush {
 public:
  StepFlush(const py::object& cache, const py::object& staging, const py::object& extra,
            const py::object& host_counters, const py::object& seen, const py::object& delta,
            const py::object& columns)
      : extra_(Array(extra, "extra", 'u', fdrr::kBytes1, 1, false)),
        counters_(Array(host_counters, "host_counters", 'i', fdrr::kBytes8, 1, false)),
        seen_(Array(seen, "seen", 'i', fdrr::kBytes8, 1, true)),
        delta_(Array(delta, "delta", 'i', fdrr::kBytes8, 1, true)) {
    const int routing = fdrr::kBytes1 | fdrr::kBytes2 | fdrr::kBytes4;
    cache_ = Array(cache, "cache", 'u', routing, 3, true);
    staging_ = Array(staging, "staging", 'u', routing, 3, false);
    CheckCacheAndStaging(cache_, staging_);
    if (staging_.shape(2) != cache_.shape(2)) {
      Refuse("staging must have the cache's top_k (" + std::to_string(cache_.shape(2)) + "), got " +
             Describe(staging));
    }
    layers_ = staging_.shape(1);
    if (counters_.shape(0) != layers_ + 1) {
      Refuse("host_counters must be int64 [1 + L] = [" + std::to_string(layers_ + 1) + "] for the staging's " +
             std::to_string(layers_) + " layers, got " + Describe(host_counters));
    }
    CheckCounterLength(counters_, seen_, "seen");
    CheckCounterLength(counters_, delta_, "delta");
    layer_bytes_ = staging_.shape(2) * staging_.itemsize();
    cache_row_ = cache_.shape(1) * layer_bytes_;
    staging_row_ = layers_ * layer_bytes_;
    cache_rows_ = cache_.shape(0);
    staging_rows_ = staging_.shape(0);
    column_.resize(static_cast<size_t>(layers_));
    if (columns.is_none()) {
      if (cache_.shape(1) != layers_) {
        Refuse("columns must name the cache row of each staged layer: the cache has " +
               std::to_string(cache_.shape(1)) + " rows for the staging's " + std::to_string(layers_) + " layers");
      }
      for (int64_t l = 0; l < layers_; ++l) column_[static_cast<size_t>(l)] = l;
    } else {
      py::array cols = Array(columns, "columns", 'i', fdrr::kBytes8, 1, false);
      if (cols.shape(0) != layers_) {
        Refuse("columns must hold one cache row per staged layer (" + std::to_string(layers_) + "), got " +
               Describe(columns));
      }
      const auto* c = static_cast<const int64_t*>(cols.data());
      for (int64_t l = 0; l < layers_; ++l) {
        if (c[l] < 0 || c[l] >= cache_.shape(1)) {
          Refuse("columns[" + std::to_string(l) + "] = " + std::to_string(c[l]) + " is outside the cache's " +
                 std::to_string(cache_.shape(1)) + " rows");
        }
        column_[static_cast<size_t>(l)] = c[l];
        identity_ = identity_ && c[l] == l;
      }
      identity_ = identity_ && cache_.shape(1) == layers_;
    }
    missing_.assign(static_cast<size_t>(layers_), 0);
  }

  // Returns (written, invalid, missing_layers, bad_ids); a token counts as written when its
  // rows of every layer were written (none stale).
  py::tuple Flush(int64_t num_tokens, int64_t slots_itemsize, bool damaged) {
    CheckItemsize(slots_itemsize, "slots_itemsize");
    if (num_tokens < 0 || num_tokens > staging_rows_ ||
        num_tokens * slots_itemsize > static_cast<int64_t>(extra_.nbytes())) {
      Refuse("num_tokens=" + std::to_string(num_tokens) + " does not fit the staging (" +
             std::to_string(staging_rows_) + " rows, " + std::to_string(extra_.nbytes()) + " bytes of slots)");
    }
    const auto* hc = static_cast<const int64_t*>(counters_.data());
    auto* sn = static_cast<int64_t*>(seen_.mutable_data());
    auto* dl = static_cast<int64_t*>(delta_.mutable_data());
    int64_t missing = 0;
    for (int64_t l = 0; l < counters_.shape(0); ++l) {
      dl[l] = hc[l] - sn[l];
      sn[l] = hc[l];
      if (l > 0) {
        missing_[static_cast<size_t>(l - 1)] = damaged || dl[l] == 0;
        if (dl[l] == 0) ++missing;
      }
    }
    const bool whole = !damaged && missing == 0;   // every layer's rows are this step's
    auto* cache = static_cast<unsigned char*>(cache_.mutable_data());
    const auto* staging = static_cast<const unsigned char*>(staging_.data());
    const void* sl = extra_.data();
    int64_t written = 0, invalid = 0;
    for (int64_t i = 0; i < num_tokens; ++i) {
      const int64_t s = ReadInt(sl, slots_itemsize, i);
      if (s < 0 || s >= cache_rows_) {
        ++invalid;
        continue;
      }
      unsigned char* row = cache + s * cache_row_;
      const unsigned char* src = staging + i * staging_row_;
      if (whole && identity_) {
        std::memcpy(row, src, static_cast<size_t>(staging_row_));
      } else {
        for (int64_t l = 0; l < layers_; ++l) {
          unsigned char* dst = row + column_[static_cast<size_t>(l)] * layer_bytes_;
          if (missing_[static_cast<size_t>(l)]) {
            std::memset(dst, 0xFF, static_cast<size_t>(layer_bytes_));
          } else {
            std::memcpy(dst, src + l * layer_bytes_, static_cast<size_t>(layer_bytes_));
          }
        }
      }
      if (whole) ++written;
    }
    return py::make_tuple(written, invalid, missing, dl[0]);
  }

 private:
  py::array extra_, counters_, seen_, delta_, cache_, staging_;
  std::vector<int64_t> column_;
  std::vector<uint8_t> missing_;
  int64_t layers_ = 0, layer_bytes_ = 0, cache_row_ = 0, staging_row_ = 0, cache_rows_ = 0, staging_rows_ = 0;
  bool identity_ = true;
};

constexpr int64_t kPackTile = 256;   // tokens per tile: their slot rows stay in L2 across the layers

// One tile of a [L, T, K] pack, layer by layer: `rows` are the tile's n slot rows, `out` the
// tile's first row of layer 0, `stride` the bytes of one layer of the output.  Each layer's
// rows of the tile are one sequential run of the output.  Rows of a fixed size (kRowBytes >
// 0) are copies the compiler inlines; rows of 8 bytes (top-8 uint8, the common case) move
// as 2 x 2 blocks of SSE2 registers, four layers a pass: two tokens' rows of four layers are
// four 16-byte loads, written as four 16-byte stores (one per layer, two tokens each), about
// half the time of 8-byte copies.
template <int64_t kRowBytes>
void PackTile(unsigned char* out, const unsigned char* const* rows, int64_t n, int64_t layers,
              int64_t row_bytes, int64_t stride) {
  int64_t l = 0;
#if defined(__SSE2__)
  if constexpr (kRowBytes == 8) {
    for (; l + 4 <= layers; l += 4) {
      unsigned char* o = out + l * stride;
      int64_t i = 0;
      for (; i + 2 <= n; i += 2, o += 16) {
        const auto* r0 = reinterpret_cast<const __m128i*>(rows[i] + l * 8);
        const auto* r1 = reinterpret_cast<const __m128i*>(rows[i + 1] + l * 8);
        const __m128i a = _mm_loadu_si128(r0), b = _mm_loadu_si128(r1);           // layers l, l+1
        const __m128i c = _mm_loadu_si128(r0 + 1), d = _mm_loadu_si128(r1 + 1);   // layers l+2, l+3
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm_unpacklo_epi64(a, b));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + stride), _mm_unpackhi_epi64(a, b));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 2 * stride), _mm_unpacklo_epi64(c, d));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 3 * stride), _mm_unpackhi_epi64(c, d));
      }
      for (; i < n; ++i, o += 8) {
        for (int64_t j = 0; j < 4; ++j) std::memcpy(o + j * stride, rows[i] + (l + j) * 8, 8);
      }
    }
  }
#endif
  const int64_t bytes = kRowBytes > 0 ? kRowBytes : row_bytes;
  for (; l < layers; ++l) {
    unsigned char* to = out + l * stride;
    for (int64_t i = 0; i < n; ++i, to += bytes) std::memcpy(to, rows[i] + l * bytes, static_cast<size_t>(bytes));
  }
}

// A finished request's rows straight from its block-table row: positions [start, length)
// map to KV slots block_row[p / block_size] * block_size + p % block_size, and their rows of
// the slot cache [S, L, K] are packed into `out` (a C-contiguous writeable [L, length -
// start, K] array of the cache's dtype: the writer's ring) or a new array when it is None.
// Every slot is checked before anything is copied (refused, naming the argument); a copy
// of 1 MiB or more runs with the GIL released.
py::array PackRequest(const py::handle& cache_obj, const py::handle& block_row_obj, const py::handle& start_obj,
                      const py::handle& length_obj, const py::handle& block_size_obj, const py::handle& out_obj) {
  const py::array cache = Array(cache_obj, "cache", 'u', fdrr::kBytes1 | fdrr::kBytes2 | fdrr::kBytes4, 3, false);
  const py::array block_row = Array(block_row_obj, "block_row", 'i', fdrr::kBytes4 | fdrr::kBytes8, 1, false);
  const int64_t start = fdrr::Int(start_obj, "start"), length = fdrr::Int(length_obj, "length");
  const int64_t block_size = fdrr::Int(block_size_obj, "block_size");
  if (block_size <= 0) Refuse("block_size must be positive, got " + std::to_string(block_size));
  if (start < 0) Refuse("start must be >= 0, got " + std::to_string(start));
  if (length < start) {
    Refuse("length must be >= start, got length=" + std::to_string(length) + ", start=" + std::to_string(start));
  }
  const int64_t num_slots = cache.shape(0), layers = cache.shape(1), top_k = cache.shape(2);
  const int64_t width = block_row.shape(0), tokens = length - start;
  if (length > 0 && (length - 1) / block_size >= width) {
    Refuse("block_row: " + std::to_string(length) + " positions need " +
           std::to_string((length - 1) / block_size + 1) + " blocks; the block table has " + std::to_string(width) +
           " for this request");
  }
  const void* row = block_row.data();
  const int64_t row_isz = block_row.itemsize();
  std::vector<int64_t> slots(static_cast<size_t>(tokens));
  int64_t unassigned = 0;
  for (int64_t p = start; p < length; ++p) {
    const int64_t blk = ReadInt(row, row_isz, p / block_size);
    if (blk < 0) {
      ++unassigned;
      continue;
    }
    const int64_t slot = blk * block_size + p % block_size;
    if (slot >= num_slots) {
      Refuse("block_row: position " + std::to_string(p) + " maps to KV slot " + std::to_string(slot) +
             ", outside the slot cache's " + std::to_string(num_slots));
    }
    slots[static_cast<size_t>(p - start)] = slot;
  }
  if (unassigned) {
    Refuse("block_row: " + std::to_string(unassigned) + " of " + std::to_string(tokens) +
           " positions have no KV block");
  }
  const int64_t elem = cache.itemsize(), row_bytes = top_k * elem, slot_bytes = layers * row_bytes;
  py::array out;
  if (out_obj.is_none()) {
    out = py::array(cache.dtype(), std::vector<py::ssize_t>{layers, tokens, top_k});
  } else {
    out = Array(out_obj, "out", 'u', static_cast<int>(cache.itemsize()), 3, true);
    if (out.shape(0) != layers || out.shape(1) != tokens || out.shape(2) != top_k) {
      Refuse("out must be of shape [" + std::to_string(layers) + ", " + std::to_string(tokens) + ", " +
             std::to_string(top_k) + "] (the cache's layers, length - start, top_k), got " + Describe(out_obj));
    }
  }
  const auto* src = static_cast<const unsigned char*>(cache.data());
  auto* dst = static_cast<unsigned char*>(out.mutable_data());
  const int64_t stride = tokens * row_bytes;
  const int64_t* slot_of = slots.data();
  auto copy = [&]() {
    const unsigned char* rows[kPackTile];
    for (int64_t t0 = 0; t0 < tokens; t0 += kPackTile) {
      const int64_t n = std::min(tokens - t0, kPackTile);
      for (int64_t i = 0; i < n; ++i) rows[i] = src + slot_of[t0 + i] * slot_bytes;
      unsigned char* tile = dst + t0 * row_bytes;
      switch (row_bytes) {
        case 8: PackTile<8>(tile, rows, n, layers, row_bytes, stride); break;
        case 16: PackTile<16>(tile, rows, n, layers, row_bytes, stride); break;
        case 32: PackTile<32>(tile, rows, n, layers, row_bytes, stride); break;
        default: PackTile<0>(tile, rows, n, layers, row_bytes, stride); break;
      }
    }
  };
  if (tokens * slot_bytes >= (int64_t{1} << 20)) {   // worth handing the GIL to other threads
    py::gil_scoped_release release;
    copy();
  } else {
    copy();
  }
  return out;
}

}  // namespace

void RegisterStepLedger(py::module_& m) {
  m.def("pack_request", &PackRequest, py::arg("cache"), py::arg("block_row"), py::arg("start"),
        py::arg("length"), py::arg("block_size"), py::arg("out") = py::none(),
        "a finished request's rows from its block-table row, packed [L, T, K] (into out when given)");
  py::class_<StepFlush>(m, "StepFlush")
      .def(py::init<const py::object&, const py::object&, const py::object&, const py::object&,
                    const py::object&, const py::object&, const py::object&>(),
           py::arg("cache"), py::arg("staging"), py::arg("extra"), py::arg("host_counters"),
           py::arg("seen"), py::arg("delta"), py::arg("columns") = py::none())
      .def("flush", &StepFlush::Flush, py::arg("num_tokens"), py::arg("slots_itemsize"),
           py::arg("damaged"));
  py::class_<StepLedger>(m, "StepLedger")
      .def(py::init<const py::object&, const py::object&, const py::object&, const py::object&,
                    const py::object&, const py::object&, const py::object&, int64_t, int64_t,
                    const py::object&, const py::object&, const py::object&, const py::object&,
                    const py::object&>(),
           py::arg("registered"), py::arg("forwarded"), py::arg("damaged"), py::arg("tokens"),
           py::arg("slots"), py::arg("finished"), py::arg("block_table"), py::arg("block_size"),
           py::arg("max_model_len"), py::arg("cache"), py::arg("staging"), py::arg("host_counters"),
           py::arg("seen"), py::arg("delta"))
      .def("plan", &StepLedger::Plan)
      .def("commit", &StepLedger::Commit)
      .def("finished", &StepLedger::Finished)
      .def_property_readonly("capacity", &StepLedger::capacity);
}
