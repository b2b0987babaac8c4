// Writes the fuzzer's seed corpus (tests/fuzz/corpus/) with the tests' GGUF builder: small valid
// files that between them reach every value type, arrays, alignment, every tensor shape rule, the
// split keys and MoE expert tensors. Run: make_seed_corpus tests/fuzz/corpus
#include <cstdio>
#include <string>
#include <vector>

#include "storage/ggml_types.h"
#include "storage/gguf.h"
#include "tests/storage/gguf_bytes.h"

using expertd::GgmlType;
using expertd::GgufValueType;
using expertd::test::GgufBuilder;
using expertd::test::GgufImage;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  std::vector<std::pair<std::string, GgufImage>> seeds;

  seeds.emplace_back("empty_v3.gguf", GgufBuilder(3).build());
  seeds.emplace_back("scalars_v2.gguf", GgufBuilder(2)
                                            .kv_u8("u8", 200)
                                            .kv_i8("i8", -100)
                                            .kv_u16("u16", 60000)
                                            .kv_i16("i16", -30000)
                                            .kv_u32("u32", 4000000000u)
                                            .kv_i32("i32", -2000000000)
                                            .kv_f32("f32", 1.5f)
                                            .kv_bool("bool", true)
                                            .kv_str("general.name", "seed")
                                            .kv_u64("u64", 1ull << 40)
                                            .kv_i64("i64", -(1ll << 40))
                                            .kv_f64("f64", 0.25)
                                            .build());
  seeds.emplace_back(
      "arrays.gguf",
      GgufBuilder()
          .kv_array<uint8_t>("a.u8", GgufValueType::UINT8, {1, 2})
          .kv_array<int16_t>("a.i16", GgufValueType::INT16, {-1, 1})
          .kv_array<uint32_t>("a.u32", GgufValueType::UINT32, {7, 8, 9})
          .kv_array<float>("a.f32", GgufValueType::FLOAT32, {0.5f, -2.0f})
          .kv_array<uint8_t>("a.bool", GgufValueType::BOOL, {1, 0})
          .kv_array<uint64_t>("a.u64", GgufValueType::UINT64, {1, 2})
          .kv_array<double>("a.f64", GgufValueType::FLOAT64, {1.0})
          .kv_str_array("tokenizer.ggml.tokens", {"<s>", "</s>", "a", "", "bc"})
          .kv_array<int32_t>("tokenizer.ggml.token_type", GgufValueType::INT32, {3, 3, 1, 1, 1})
          .build());
  seeds.emplace_back("tensors.gguf", GgufBuilder()
                                         .kv_str("general.architecture", "llama")
                                         .kv_u32("llama.block_count", 1)
                                         .tensor("token_embd.weight", {4, 3}, GgmlType::F32)
                                         .tensor("blk.0.attn_q.weight", {32, 2}, GgmlType::Q8_0)
                                         .tensor("blk.0.attn_k.weight", {32, 1}, GgmlType::Q4_0)
                                         .tensor("blk.0.ffn_down.weight", {256}, GgmlType::Q4_K)
                                         .tensor("output_norm.weight", {8}, GgmlType::F16)
                                         .tensor("output.weight", {2, 2, 2, 2}, GgmlType::BF16)
                                         .build());
  seeds.emplace_back("align64.gguf", GgufBuilder()
                                         .alignment(64)
                                         .tensor("a", {3}, GgmlType::F32)
                                         .tensor("b", {32}, GgmlType::Q8_0)
                                         .build());
  seeds.emplace_back("moe.gguf",
                     GgufBuilder()
                         .kv_str("general.architecture", "qwen3moe")
                         .kv_u32("qwen3moe.expert_count", 4)
                         .kv_u32("qwen3moe.expert_used_count", 2)
                         .tensor("blk.0.ffn_gate_inp.weight", {32, 4}, GgmlType::F32)
                         .tensor("blk.0.ffn_gate_exps.weight", {32, 2, 4}, GgmlType::Q8_0)
                         .tensor("blk.0.ffn_up_exps.weight", {32, 2, 4}, GgmlType::Q8_0)
                         .tensor("blk.0.ffn_down_exps.weight", {32, 1, 4}, GgmlType::Q8_0)
                         .build());
  seeds.emplace_back("split-00001-of-00002.gguf", expertd::test::split_model(2)[0]);
  seeds.emplace_back("split-00002-of-00002.gguf", expertd::test::split_model(2)[1]);

  for (const auto& [name, image] : seeds) {
    if (image.bytes.size() > 4096) {
      std::fprintf(stderr, "%s is %zu bytes: seeds stay under 4 KiB\n", name.c_str(),
                   image.bytes.size());
      return 1;
    }
    image.write(dir + "/" + name);
    std::printf("%s %zu bytes\n", name.c_str(), image.bytes.size());
  }
  return 0;
}
