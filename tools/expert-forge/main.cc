// expert-forge: writes a synthetic llama.cpp `qwen3moe`, `deepseek4`, Mixtral or DeepSeek-V3
// (`deepseek2`) GGUF model whose every byte is derived from a seed (forge/content.h), fast enough
// to make tens-of-GB models at disk speed.
//
// Generator threads fill fixed 8 MiB chunk buffers in parallel; the main thread writes the chunks
// in file order, so the disk is never idle while content is computed. Nothing appears under an
// output name before every shard was written whole (GgufWriter commits by rename).
#include <fmt/format.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "forge/content.h"
#include "forge/plan.h"

namespace expertd {
namespace {

constexpr uint64_t kChunkBytes = 8u << 20;

// Set by SIGINT/SIGTERM; the write loop polls it between chunks. A signal handler can only talk
// through a lock-free global.
std::atomic<bool> g_interrupted{false};
static_assert(std::atomic<bool>::is_always_lock_free);

extern "C" void on_signal(int) { g_interrupted.store(true, std::memory_order_relaxed); }

void install_signal_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESETHAND;  // a second signal kills at once
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

double gb(uint64_t bytes) { return static_cast<double>(bytes) / 1e9; }

std::string dir_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// One refreshing line on a terminal, a plain line every few seconds otherwise.
class Progress {
 public:
  explicit Progress(uint64_t total_bytes)
      : total_(total_bytes),
        tty_(::isatty(STDERR_FILENO) == 1),
        start_(Clock::now()),
        last_(start_) {}

  void update(uint64_t done_bytes) {
    const auto now = Clock::now();
    const auto every = tty_ ? std::chrono::milliseconds(200) : std::chrono::milliseconds(5000);
    if (now - last_ < every) return;
    last_ = now;
    const double s = seconds(now);
    const double rate = s > 0 ? gb(done_bytes) / s : 0;
    const double eta = rate > 0 ? gb(total_ - done_bytes) / rate : 0;
    const std::string line =
        fmt::format("expert-forge: {:.2f} / {:.2f} GB  {:3.0f}%  {:.2f} GB/s  ETA {:.0f} s",
                    gb(done_bytes), gb(total_), 100.0 * gb(done_bytes) / gb(total_), rate, eta);
    if (tty_) {
      fmt::print(stderr, "\r{}\x1b[K", line);
      shown_ = true;
    } else {
      fmt::print(stderr, "{}\n", line);
    }
  }

  // Ends the refreshing line so the next message starts on its own.
  void close() {
    if (shown_) fmt::print(stderr, "\r\x1b[K");
    shown_ = false;
  }

 private:
  using Clock = std::chrono::steady_clock;
  double seconds(Clock::time_point t) const {
    return std::chrono::duration<double>(t - start_).count();
  }
  uint64_t total_;
  bool tty_;
  bool shown_ = false;
  Clock::time_point start_;
  Clock::time_point last_;
};

struct Chunk {
  uint32_t shard;
  const GgufTensorInfo* tensor;
  uint64_t offset;  // in the tensor
  uint64_t bytes;
};

// Generates chunks on `threads` workers into a ring of buffers and hands them to the writer in
// order. Slot k % slots holds chunk k; a worker may fill chunk k only after the writer consumed
// chunk k - slots, so memory stays at slots x kChunkBytes.
class ChunkPipeline {
 public:
  ChunkPipeline(uint64_t seed, uint32_t expert_count, std::vector<Chunk> chunks, uint32_t threads)
      : seed_(seed),
        expert_count_(expert_count),
        chunks_(std::move(chunks)),
        slots_(2 * threads + 2) {
    buffers_.reserve(slots_);
    ready_.assign(slots_, kNone);
    for (uint32_t i = 0; i < slots_; ++i)
      buffers_.push_back(std::make_unique<uint8_t[]>(kChunkBytes));
    for (uint32_t i = 0; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }
  ~ChunkPipeline() {
    stop();
    for (auto& t : workers_) t.join();
  }
  ChunkPipeline(const ChunkPipeline&) = delete;
  ChunkPipeline& operator=(const ChunkPipeline&) = delete;

  size_t size() const { return chunks_.size(); }
  const Chunk& chunk(size_t k) const { return chunks_[k]; }

  // Blocks until chunk k is generated; k must be the next chunk in order.
  Result<std::span<const uint8_t>> wait(size_t k) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return ready_[k % slots_] == k || error_; });
    if (error_) return *error_;
    return std::span<const uint8_t>(buffers_[k % slots_].get(), chunks_[k].bytes);
  }
  // The writer is done with chunk k: its slot may take chunk k + slots.
  void release(size_t k) {
    {
      std::lock_guard lock(mu_);
      consumed_ = k + 1;
    }
    cv_.notify_all();
  }
  void stop() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
  }

 private:
  static constexpr size_t kNone = SIZE_MAX;

  void work() {
    for (;;) {
      size_t k = 0;
      {
        std::unique_lock lock(mu_);
        if (stopping_ || next_ >= chunks_.size()) return;
        k = next_++;
        cv_.wait(lock, [&] { return stopping_ || consumed_ + slots_ > k; });
        if (stopping_) return;
      }
      const Chunk& c = chunks_[k];
      auto st = forge_expected_bytes(seed_, *c.tensor, c.offset,
                                     std::span<uint8_t>(buffers_[k % slots_].get(), c.bytes),
                                     expert_count_);
      {
        std::lock_guard lock(mu_);
        if (!st) {
          if (!error_) error_ = st.take_error();
        } else {
          ready_[k % slots_] = k;
        }
      }
      cv_.notify_all();
    }
  }

  const uint64_t seed_;
  const uint32_t expert_count_;  // the range of hash-routing tables
  const std::vector<Chunk> chunks_;
  const uint32_t slots_;
  std::vector<std::unique_ptr<uint8_t[]>> buffers_;
  std::vector<std::thread> workers_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<size_t> ready_;  // per slot: the chunk it holds, complete
  size_t next_ = 0;            // next chunk to hand to a worker
  size_t consumed_ = 0;        // chunks the writer is done with
  bool stopping_ = false;
  std::optional<Error> error_;
};

std::vector<Chunk> plan_chunks(const std::vector<ForgeShard>& shards) {
  std::vector<Chunk> chunks;
  for (uint32_t s = 0; s < shards.size(); ++s) {
    for (const GgufTensorInfo& t : shards[s].writer.tensors()) {
      for (uint64_t off = 0; off < t.bytes; off += kChunkBytes) {
        chunks.push_back(Chunk{s, &t, off, std::min(kChunkBytes, t.bytes - off)});
      }
    }
  }
  return chunks;
}

Status check_outputs(const std::vector<ForgeShard>& shards, bool force, uint64_t total_bytes) {
  for (const ForgeShard& s : shards) {
    struct stat st {};
    if (!force && ::lstat(s.path.c_str(), &st) == 0) {
      return make_error(EEXIST, fmt::format("{} exists; pass --force to overwrite it", s.path));
    }
  }
  const std::string dir = dir_of(shards[0].path);
  struct statvfs fs {};
  if (::statvfs(dir.c_str(), &fs) != 0) {
    const int e = errno;
    return make_error(e, fmt::format("output directory {}: {}", dir, std::strerror(e)));
  }
  const uint64_t free_bytes = uint64_t{fs.f_bavail} * fs.f_frsize;
  if (total_bytes > free_bytes) {
    return make_error(ENOSPC, fmt::format("the model needs {:.2f} GB but {} has {:.2f} GB free",
                                          gb(total_bytes), dir, gb(free_bytes)));
  }
  return Ok{};
}

// Writes every shard to its temporary file, then commits them all.
Status forge(const ForgeConfig& config, std::vector<ForgeShard>& shards, bool force,
             uint32_t threads, Progress& progress) {
  ChunkPipeline pipeline(config.seed, config.experts, plan_chunks(shards), threads);
  GgufWriterOptions options;
  options.overwrite = force;
  uint64_t done_bytes = 0;  // in finished shards
  size_t k = 0;
  for (uint32_t s = 0; s < shards.size(); ++s) {
    GgufWriter& w = shards[s].writer;
    EXPERTD_TRY(w.begin(shards[s].path, options));
    for (; k < pipeline.size() && pipeline.chunk(k).shard == s; ++k) {
      if (g_interrupted.load(std::memory_order_relaxed)) {
        return make_error(EINTR, "interrupted; the partial files were removed");
      }
      std::span<const uint8_t> data;
      EXPERTD_TRY_ASSIGN(data, pipeline.wait(k));
      EXPERTD_TRY(w.write(data));
      pipeline.release(k);
      progress.update(done_bytes + w.bytes_written());
    }
    EXPERTD_TRY(w.finish());
    done_bytes += w.file_bytes();
  }
  for (uint32_t s = 0; s < shards.size(); ++s) {
    if (auto st = shards[s].writer.commit(); !st) {
      // A model missing a shard is no model: take back the shards already committed.
      for (uint32_t i = 0; i < s; ++i) ::unlink(shards[i].path.c_str());
      return st.take_error();
    }
  }
  return Ok{};
}

int run(int argc, char** argv) {
  const ForgeConfig q = forge_defaults(ForgeArch::Qwen3Moe);
  const ForgeConfig d = forge_defaults(ForgeArch::Deepseek4);
  const ForgeConfig m = forge_defaults(ForgeArch::Mixtral);
  const ForgeConfig v3 = forge_defaults(ForgeArch::Deepseek3);
  const ForgeConfig g = forge_defaults(ForgeArch::GptOss);
  const ForgeConfig glm = forge_defaults(ForgeArch::Glm4Moe);
  ForgeConfig c = q;  // the flags without an arch-dependent default parse straight into it
  // The families' short names (the registry's: engine/family.h).
  const std::string aq(forge_arch_name(ForgeArch::Qwen3Moe));
  const std::string ad(forge_arch_name(ForgeArch::Deepseek4));
  const std::string am(forge_arch_name(ForgeArch::Mixtral));
  const std::string a3(forge_arch_name(ForgeArch::Deepseek3));
  const std::string ag(forge_arch_name(ForgeArch::GptOss));
  const std::string aglm(forge_arch_name(ForgeArch::Glm4Moe));
  std::string arch = aq;
  std::optional<uint32_t> experts, top_k, heads, kv_heads;
  std::optional<uint64_t> embd, ff, head_dim;
  std::optional<uint32_t> hash_layers, dense_layers;
  std::string expert_type = "q8_0";
  std::optional<std::string> dense_type;
  std::string compress_ratios;
  bool force = false;
  uint32_t threads = std::clamp(std::thread::hardware_concurrency(), 1u, 8u);

  CLI::App app{
      fmt::format("expert-forge: write a synthetic llama.cpp GGUF model of {} whose every "
                  "byte is derived from --seed (and can be recomputed to verify a read)",
                  forge_arch_names())};
  app.set_version_flag("--version", std::string("expert-forge ") + EXPERTD_VERSION);
  // A later flag overrides an earlier one, so scripts can append to a base command line.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  // "(qwen3moe Q, deepseek4 D, mixtral M)": the default of a flag that depends on --arch.
  auto both = [&](auto qv, auto dv, auto mv) {
    return fmt::format(" (default: {} {}, {} {}, {} {})", aq, qv, ad, dv, am, mv);
  };
  app.add_option("--arch", arch,
                 fmt::format("model architecture: {} (or llama.cpp's architecture). {}'s "
                             "defaults are DeepSeek-V3's widths, {}'s gpt-oss-120b's (--window "
                             "is its sliding window), {}'s GLM-4.5-Air's with one MTP block "
                             "(--qk-norm for GLM-4.5's q/k norms)",
                             forge_arch_names(), a3, ag, aglm))
      ->capture_default_str();
  app.add_option("--layers", c.layers, "transformer blocks")->capture_default_str();
  app.add_option("--experts", experts,
                 "routed experts per layer" + both(q.experts, d.experts, m.experts));
  app.add_option("--top-k", top_k, "experts used per token" + both(q.top_k, d.top_k, m.top_k));
  app.add_option("--embd", embd, "embedding length" + both(q.embd, d.embd, m.embd));
  app.add_option("--ff", ff, "expert feed-forward length" + both(q.ff, d.ff, m.ff));
  app.add_option("--heads", heads, "attention heads" + both(q.heads, d.heads, m.heads));
  app.add_option("--kv-heads", kv_heads,
                 "key/value heads" + both(q.kv_heads, d.kv_heads, m.kv_heads));
  app.add_option("--head-dim", head_dim,
                 "head dimension" + both(q.head_dim, d.head_dim, m.head_dim));
  app.add_option("--vocab", c.vocab, "vocabulary size (>= 258)")->capture_default_str();
  app.add_option("--context", c.context, "context length (metadata)")->capture_default_str();
  app.add_option("--expert-type", expert_type,
                 fmt::format("type of the expert tensors: {}", forge_type_names()))
      ->capture_default_str();
  app.add_option("--dense-type", dense_type,
                 fmt::format("type of embeddings, attention, shared experts and output: {} "
                             "(norms, routers and {}'s hyper-connections are f32)",
                             forge_type_names(), ad) +
                     both(ggml_type_name(q.dense_type), ggml_type_name(d.dense_type),
                          ggml_type_name(m.dense_type)));
  app.add_option("--alignment", c.alignment, "data alignment in bytes, a power of two")
      ->capture_default_str();
  app.add_option("--split", c.split, "number of shards (NAME-0000i-of-0000N.gguf)")
      ->capture_default_str();
  app.add_option("--seed", c.seed, "content seed")->capture_default_str();
  app.add_option("--name", c.name, "general.name (default: a description of the shape)");
  app.add_option("--threads", threads, "content generator threads")->capture_default_str();
  app.add_option("-o,--output", c.output, "output file (the base name when --split > 1)")
      ->required();
  app.add_flag("--force", force, "overwrite existing output files");
  const std::string ds4 = fmt::format("DeepSeek-V4 (--arch {})", ad);
  app.add_option("--q-lora-rank", c.q_lora_rank, "query LoRA rank")
      ->capture_default_str()
      ->group(ds4);
  app.add_option("--o-groups", c.o_groups, "output projection groups")
      ->capture_default_str()
      ->group(ds4);
  app.add_option("--o-lora-rank", c.o_lora_rank, "output LoRA rank per group")
      ->capture_default_str()
      ->group(ds4);
  app.add_option("--rope-dim", c.rope_dim, "rotary dimensions of a head")
      ->capture_default_str()
      ->group(ds4);
  app.add_option("--window", c.window, "sliding window")->capture_default_str()->group(ds4);
  app.add_option("--index-heads", c.index_heads, "indexer heads")
      ->capture_default_str()
      ->group(ds4);
  app.add_option("--index-head-dim", c.index_head_dim, "indexer head dimension")
      ->capture_default_str()
      ->group(ds4);
  app.add_option("--index-topk", c.index_topk, "compressed entries the indexer keeps")
      ->capture_default_str()
      ->group(ds4);
  app.add_option("--hash-layers", hash_layers,
                 fmt::format("first blocks that route by token id (ffn_gate_tid2eid) (default: "
                             "{}, at most --layers)",
                             d.hash_layers))
      ->group(ds4);
  app.add_option("--hc-mult", c.hc_mult, "hyper-connection streams")
      ->capture_default_str()
      ->group(ds4);
  app.add_option("--shared-experts", c.shared_experts, "shared experts per layer")
      ->capture_default_str()
      ->group(ds4);
  app.add_option("--nextn", c.nextn, "MTP (nextn) blocks after the --layers main ones")
      ->capture_default_str()
      ->group(ds4);
  app.add_option("--compress-ratios", compress_ratios,
                 "per block 0 (sliding), 4 (CSA) or 128 (HCA), comma-separated (default: "
                 "transformers' schedule: 128, 128, then 128/4 alternating; MTP blocks 0)")
      ->group(ds4);
  const std::string v3g =
      fmt::format("DeepSeek-V3 (--arch {}; also --q-lora-rank, --rope-dim, --shared-experts)", a3);
  app.add_option("--kv-lora-rank", c.kv_lora_rank, "compressed KV latent width")
      ->capture_default_str()
      ->group(v3g);
  app.add_option("--v-head-dim", c.v_head_dim, "value head dimension")
      ->capture_default_str()
      ->group(v3g);
  app.add_option("--dense-layers", dense_layers,
                 fmt::format("leading blocks with a dense MLP (default: {}, below --layers)",
                             v3.dense_layers))
      ->group(v3g);
  app.add_option("--dense-ff", c.dense_ff, "the dense MLP's width")
      ->capture_default_str()
      ->group(v3g);
  app.add_option("--expert-groups", c.expert_groups, "expert groups")
      ->capture_default_str()
      ->group(v3g);
  app.add_option("--groups-used", c.groups_used, "groups the top-k is chosen from")
      ->capture_default_str()
      ->group(v3g);
  const std::string glmg = fmt::format(
      "GLM-4.5 (--arch {}; also --rope-dim (default --head-dim / 2), --nextn, "
      "--shared-experts, --dense-layers, --dense-ff, --expert-groups, --groups-used, with "
      "GLM-4.5-Air's defaults)",
      aglm);
  app.add_flag("--qk-norm", c.qk_norm, "per-head q/k norms (GLM-4.5 has them, GLM-4.5-Air not)")
      ->group(glmg);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  auto usage_error = [](const Error& e) {
    fmt::print(stderr, "expert-forge: {}\n", e.message);
    return 2;
  };
  auto parsed_arch = parse_forge_arch(arch);
  if (!parsed_arch) return usage_error(parsed_arch.error());
  c.arch = *parsed_arch;
  const ForgeConfig& base = c.arch == ForgeArch::Deepseek4   ? d
                            : c.arch == ForgeArch::Mixtral   ? m
                            : c.arch == ForgeArch::Deepseek3 ? v3
                            : c.arch == ForgeArch::GptOss    ? g
                            : c.arch == ForgeArch::Glm4Moe   ? glm
                                                             : q;
  c.experts = experts.value_or(base.experts);
  c.top_k = top_k.value_or(base.top_k);
  c.embd = embd.value_or(base.embd);
  c.ff = ff.value_or(base.ff);
  c.heads = heads.value_or(base.heads);
  c.kv_heads = kv_heads.value_or(base.kv_heads);
  c.head_dim = head_dim.value_or(base.head_dim);
  // As transformers does: the first min(layers, 3) blocks hash-route unless told otherwise.
  c.hash_layers = hash_layers.value_or(std::min(base.hash_layers, c.layers));
  // DeepSeek-V3's 3 dense blocks, fewer in a smaller model: at least one block has experts.
  c.dense_layers = dense_layers.value_or(std::min(v3.dense_layers, c.layers - 1));
  if (c.arch == ForgeArch::Deepseek3) {
    if (app.count("--q-lora-rank") == 0) c.q_lora_rank = v3.q_lora_rank;
  }
  if (c.arch == ForgeArch::Glm4Moe) {
    // GLM-4.5-Air's MoE block where the flag is not given; half the head rotates.
    c.dense_layers = dense_layers.value_or(std::min(glm.dense_layers, c.layers - 1));
    if (app.count("--rope-dim") == 0) c.rope_dim = static_cast<uint32_t>(c.head_dim / 2);
    if (app.count("--dense-ff") == 0) c.dense_ff = glm.dense_ff;
    if (app.count("--expert-groups") == 0) c.expert_groups = glm.expert_groups;
    if (app.count("--groups-used") == 0) c.groups_used = glm.groups_used;
    if (app.count("--nextn") == 0) c.nextn = glm.nextn;
  } else if (c.qk_norm) {
    return usage_error(make_error(EINVAL, fmt::format("--qk-norm: only with --arch {}", aglm)));
  }
  auto et = parse_forge_type("--expert-type", expert_type);
  if (!et) return usage_error(et.error());
  c.expert_type = *et;
  c.dense_type = base.dense_type;
  if (dense_type) {
    auto dt = parse_forge_type("--dense-type", *dense_type);
    if (!dt) return usage_error(dt.error());
    c.dense_type = *dt;
  }
  if (!compress_ratios.empty()) {
    if (c.arch != ForgeArch::Deepseek4) {
      return usage_error(
          make_error(EINVAL, fmt::format("--compress-ratios: only with --arch {}", ad)));
    }
    auto r = parse_compress_ratios(compress_ratios);
    if (!r) return usage_error(r.error());
    c.compress_ratios = std::move(r).value();
  }
  if (threads < 1 || threads > 256) {
    return usage_error(
        make_error(EINVAL, fmt::format("--threads {}: must be between 1 and 256", threads)));
  }
  if (auto st = validate_forge_config(c); !st) return usage_error(st.error());

  auto planned = plan_forge_model(c);
  if (!planned) return usage_error(planned.error());
  std::vector<ForgeShard> shards = std::move(planned).value();
  uint64_t total_bytes = 0;
  uint64_t tensors = 0;
  for (const ForgeShard& s : shards) {
    total_bytes += s.writer.file_bytes();
    tensors += s.writer.tensors().size();
  }
  if (auto st = check_outputs(shards, force, total_bytes); !st) {
    fmt::print(stderr, "expert-forge: {}\n", st.error().message);
    return 1;
  }
  fmt::print(stderr,
             "expert-forge: {} {} layers x {} experts (top {}), embd {}, ff {}, experts "
             "{}, dense {}, vocab {}: {:.3f} GB in {} file{}\n",
             forge_arch_name(c.arch), c.layers, c.experts, c.top_k, c.embd, c.ff,
             ggml_type_name(c.expert_type), ggml_type_name(c.dense_type), c.vocab, gb(total_bytes),
             shards.size(), shards.size() == 1 ? "" : "s");

  install_signal_handlers();
  const auto start = std::chrono::steady_clock::now();
  Progress progress(total_bytes);
  auto st = forge(c, shards, force, threads, progress);
  progress.close();
  if (!st) {
    fmt::print(stderr, "expert-forge: {}\n", st.error().message);
    return st.error().code == EINTR ? 130 : 1;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::string where = shards.size() == 1
                                ? shards[0].path
                                : fmt::format("{} .. {}", shards.front().path, shards.back().path);
  fmt::print(stderr, "expert-forge: wrote {} ({} bytes, {} tensors) in {:.2f} s: {:.2f} GB/s\n",
             where, total_bytes, tensors, s, s > 0 ? gb(total_bytes) / s : 0.0);
  return 0;
}

}  // namespace
}  // namespace expertd

int main(int argc, char** argv) { return expertd::run(argc, argv); }
