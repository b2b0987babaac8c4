// Routing traces: which experts each (token, layer) was routed to, in time order.
//
// Canonical form: JSON Lines, one record per (token, layer), token-major with layers ascending:
//   {"token": 12, "layer": 3, "experts": [5, 2], "weights": [0.71, 0.29]}
// "weights" may be absent (then the record carries none). An optional
//   "predicted": {"1": [5, 7], "2": [5]}
// gives the experts the router lookahead predicted for this (token, layer) from 1, 2, ... layers
// earlier (depths 1..255, at most 255 ids each). Tokens never decrease and, within a token,
// layers strictly increase; every record routes to at least one expert (at most 255).
//
// Compact binary form (".etrace"), little-endian, for long traces:
//   header   "EXTR"  u32 version (1)  u64 record count
//   record   u32 token  u16 layer  u8 n_experts  u8 n_pred_depths
//            u16 experts[n_experts]  f32 weights[n_experts]
//            n_pred_depths x { u8 depth  u8 n_ids  u16 ids[n_ids] }   (depths strictly ascending)
// A record without weights stores quiet NaNs, read back as no weights. Nothing may follow the
// last record. Layers and expert ids must fit u16 to be written in this form.
//
// Every loader checks the same rules; an error names the file and line (JSONL) or the record
// index and byte offset (binary). Counts in a binary file are checked against the bytes left
// before anything is allocated, so a truncated or hostile file is an Error, never a crash.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "expertd/result.h"
#include "storage/expert_key.h"

namespace expertd {

struct TraceRecord {
  uint32_t token = 0;
  uint32_t layer = 0;
  std::vector<uint32_t> experts;
  std::vector<float> weights;  // empty, or one per expert
  // Lookahead depth in layers (1..255) -> the experts predicted for this record at that depth.
  std::map<uint32_t, std::vector<uint32_t>> predicted;
  friend bool operator==(const TraceRecord&, const TraceRecord&) = default;
};

struct Trace {
  std::vector<TraceRecord> records;
  uint32_t layers = 0;   // 1 + the largest layer seen
  uint32_t experts = 0;  // 1 + the largest expert id seen
  uint32_t tokens = 0;   // distinct tokens
  // Every routed expert of every record, in file order and listed order.
  std::vector<ExpertKey> accesses() const;
};

// The magic that starts a binary trace.
inline constexpr char kTraceBinaryMagic[4] = {'E', 'X', 'T', 'R'};
inline constexpr uint32_t kTraceBinaryVersion = 1;

Result<Trace> load_trace_jsonl(const std::string& path);
Result<Trace> load_trace_binary(const std::string& path);
// Binary if the file starts with "EXTR", else JSON Lines.
Result<Trace> load_trace(const std::string& path);

// Writers check the trace against the rules above (and the binary field widths) before writing.
Status write_trace_jsonl(const std::string& path, const Trace& trace);
Status write_trace_binary(const std::string& path, const Trace& trace);

// A raw routing log, as collected with vLLM hooks: JSON Lines of
//   {"layer": L, "token_idx"|"token_pos": P, "experts": [...], "gating_probs": [...]}
// Prefill records come layer-major with their prompt positions; decode records may all carry
// position 0 and come in time order, one token's layers ascending. Decode tokens are numbered on
// from the prompt length, a new one starting wherever the layer does not increase. Weights are
// rounded to 6 decimals, as in the canonical files. Records missing from the log stay missing.
Result<Trace> import_raw_log(const std::string& path);

// A generated trace (trace/synth.h's synthesize_trace) with 1/(rank+1) popularity, uniform
// weights, and each expert chosen for the previous token kept with probability `reuse`. The
// calibrated shapes are in trace/synth.h (SynthParams::mixtral, ::wide).
Trace make_synthetic_trace(uint32_t tokens, uint32_t layers, uint32_t experts, uint32_t top_k,
                           uint64_t seed, double reuse = 0.4);

}  // namespace expertd
