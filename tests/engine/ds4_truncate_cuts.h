// The run and the cuts both DeepSeek-V4 truncate tests make (Ds4Forward.TruncateToAnyPosition...
// on the CPU engine in ds4_forward_test.cc, Ds4GpuEngine's in gpu_engine_test.cc): the engines
// share one checkpoint policy (Ds4CheckpointSlots), so each cut feeds the same positions again.
#pragma once

#include <cstdint>

#include "engine/ds4_cpu_engine.h"

namespace expertd::engine::test {

// ids[i] = (i * 37 + 11) % vocab; the first kDs4CutPrompt prefilled in chunks of kDs4CutChunk
// (checkpoints at 8, 16, 20), then decoded up to kDs4CutDecoded before the first cut. Each cut is
// followed by three decoded positions.
inline constexpr uint32_t kDs4CutTokens = 160;
inline constexpr uint32_t kDs4CutPrompt = 20;
inline constexpr uint32_t kDs4CutChunk = 8;
inline constexpr uint32_t kDs4CutDecoded = 150;

// truncate(n) and the positions it feeds again (refed). The four checkpoints: the prompt's chunk
// ends 8, 16, 20, then decode's 64, and 128 in place of 8 (the earliest goes first); a cut keeps
// its own position and drops those after it.
struct Ds4Cut {
  uint32_t n;
  uint64_t refed;
};
inline constexpr Ds4Cut kDs4Cuts[] = {
    {149, 21},  // from 128; keeps 149 in place of 16: {20, 64, 128, 149}
    {128, 0},   // at one; 149 dropped
    {99, 35},   // from 64; 128 dropped, 99 kept: {20, 64, 99}
    {100, 1},   // from 99, which the last cut kept: {20, 64, 99, 100}
    {64, 0},    // at one; 99 and 100 dropped
    {45, 25},   // from 20 (the prompt's end); 64 dropped: {20, 45}
    {17, 17},   // none at or before 17 is left: from 0, keeping 17
    {13, 13},   // likewise
    {5, 5},    {0, 0}};
static_assert(Ds4CheckpointSlots::kCount == 4 && Ds4CheckpointSlots::kEvery == 64,
              "kDs4Cuts follows 4 checkpoints, one every 64 decoded positions");

}  // namespace expertd::engine::test
