// Loads a GGUF model in llama.cpp (CPU), decodes a prompt longer than a small window and 16 greedy
// tokens, and checks every logit is finite. Prints the largest |logit| and the rms per step.
// Exit 0 only when the model loads and the forward stays finite.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "llama.h"

namespace {

bool check_logits(llama_context* ctx, int n_vocab, const std::string& what) {
  const float* l = llama_get_logits_ith(ctx, -1);
  if (l == nullptr) {
    std::fprintf(stderr, "%s: no logits\n", what.c_str());
    return false;
  }
  double max_abs = 0;
  double sum_sq = 0;
  for (int i = 0; i < n_vocab; ++i) {
    if (!std::isfinite(l[i])) {
      std::fprintf(stderr, "%s: logit %d is %f\n", what.c_str(), i, l[i]);
      return false;
    }
    max_abs = std::fmax(max_abs, std::fabs(l[i]));
    sum_sq += static_cast<double>(l[i]) * l[i];
  }
  std::printf("%s: logits finite, max |l| %.3f, rms %.3f\n", what.c_str(), max_abs,
              std::sqrt(sum_sq / n_vocab));
  return true;
}

// One sequence: tokens at positions pos0.., logits for the last one only.
void fill(llama_batch_ext* batch, const llama_token* tokens, int n, llama_pos pos0) {
  llama_batch_ext_clear(batch);
  for (int i = 0; i < n; ++i) {
    const int32_t idx = llama_batch_ext_add_token(batch, 0, tokens[i]);
    const llama_pos pos = pos0 + i;
    llama_batch_ext_set_pos(batch, idx, &pos);
  }
  llama_batch_ext_set_output_logits(batch, n - 1, true);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s MODEL.gguf\n", argv[0]);
    return 2;
  }
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (model == nullptr) {
    std::fprintf(stderr, "%s: llama.cpp cannot load it\n", argv[1]);
    return 1;
  }
  const llama_vocab* vocab = llama_model_get_vocab(model);
  const int n_vocab = llama_vocab_n_tokens(vocab);
  const std::string prompt = "hello world the quick brown fox jumps over";
  std::vector<llama_token> tokens(256);
  const int n = llama_tokenize(vocab, prompt.c_str(), static_cast<int32_t>(prompt.size()),
                               tokens.data(), static_cast<int32_t>(tokens.size()), false, true);
  if (n <= 0) {
    std::fprintf(stderr, "tokenize failed\n");
    return 1;
  }
  tokens.resize(n);
  std::printf("prompt: %d tokens\n", n);
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = 256;
  cp.n_batch = 256;
  cp.n_ubatch = 256;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (ctx == nullptr) {
    std::fprintf(stderr, "cannot make a context\n");
    return 1;
  }
  llama_batch_ext* batch = llama_batch_ext_init(ctx);
  fill(batch, tokens.data(), n, 0);
  bool ok = llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch) == 0 &&
            check_logits(ctx, n_vocab, "prompt");
  llama_pos pos = n;
  for (int step = 0; ok && step < 16; ++step) {
    const float* l = llama_get_logits_ith(ctx, -1);
    llama_token best = 0;
    for (int i = 1; i < n_vocab; ++i) {
      if (l[i] > l[best]) best = i;
    }
    fill(batch, &best, 1, pos++);
    ok = llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch) == 0 &&
         check_logits(ctx, n_vocab,
                      "step " + std::to_string(step) + " (token " + std::to_string(best) + ")");
  }
  std::puts(ok ? "OK" : "FAILED");
  llama_batch_ext_free(batch);
  llama_free(ctx);
  llama_model_free(model);
  return ok ? 0 : 1;
}
