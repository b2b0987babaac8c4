// llama-feed: llama.cpp fed the same token ids as expertd (issue 23). bench/peer/peer.sh builds it
// beside llama-bench against that build's libllama, using only llama.cpp's public API (llama.h,
// ggml-backend.h, ggml-cpu.h).
//
// llama-bench's `tg` decodes ids it draws itself (std::rand() % n_vocab) and expert-run used to
// decode the tokens it sampled, so the two engines never saw the same input. This driver decodes
// exactly the ids of a file, one llama_decode per id, timed as llama-bench times `tg`:
//   1. load the model and a context (timed: with mmap, llama.cpp reads the whole file here);
//   2. prefill the --prompt-ids in chunks of -b (llama_batch_get_one), llama_synchronize -> pp;
//   3. llama_memory_clear, then each --feed id in its own llama_decode + llama_synchronize, from
//      an empty context as llama-bench's tg starts -> tg tokens/s, per-token p50/p99.
// Around each phase it reads /proc/self/io: read_bytes counts what this process made the kernel
// read from storage, page faults of the mmapped file included, so tg's bytes per token is the
// figure to set beside expertd's. One JSON line on stdout at the end; logs on stderr. The JSON and
// the argument parsing are written by hand rather than with nlohmann-json and CLI11: peer.sh
// compiles this file with a bare g++ against llama.cpp's tree on the device machine, which has
// neither library.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "llama.h"

#ifndef LLAMA_FEED_BUILD_COMMIT
#define LLAMA_FEED_BUILD_COMMIT ""
#endif

namespace {

const char* const kUsage =
    "Usage: llama-feed -m MODEL --prompt-ids FILE --feed FILE [OPTIONS]\n"
    "\n"
    "llama.cpp fed given token ids: prefill FILE's ids (pp), then, from an empty context, decode\n"
    "each --feed id with its own llama_decode (tg), timed as llama-bench times pp and tg. Prints\n"
    "one JSON line: load_s, pp and tg tokens/s, tg ms per token p50/p99, and the bytes read from\n"
    "storage (/proc/self/io read_bytes, mmap page faults included) in each phase.\n"
    "\n"
    "  -m, --model FILE       the GGUF\n"
    "  --prompt-ids FILE      the prefill ids, comma, space or newline separated (may be empty:\n"
    "                         no pp phase)\n"
    "  --feed FILE            the decode ids, same format (at least one)\n"
    "  -ngl N                 layers on the GPU (default -1: all, llama-bench's default)\n"
    "  -ncmoe N               the routed experts of blocks 0..N-1 stay in CPU memory (tensors\n"
    "                         blk.I.ffn_{up,down,gate,gate_up}_{,ch}exps; llama-bench's -ncmoe)\n"
    "  -lm, --load-mode M     auto|none|mmap|mlock|mmap+mlock|dio (default mmap)\n"
    "  --repack               let the CPU backend repack weights into its own buffers\n"
    "                         (use_extra_bufts). OFF by default, unlike llama-bench: repacking\n"
    "                         copies the experts into anonymous memory, an OOM kill under a\n"
    "                         memory cap smaller than the model\n"
    "  --no-repack            the default, accepted for symmetry with llama-completion\n"
    "  -t N                   threads (default: the physical cores)\n"
    "  -b N                   logical batch (default 2048, llama-bench's)\n"
    "  -ub N                  physical batch (default 512, llama-bench's)\n"
    "  -fa on|off|auto        flash attention (default auto, llama-bench's)\n"
    "  --verbose              llama.cpp's own log on stderr (quiet otherwise)\n"
    "  -h, --help             this text\n";

struct Options {
  std::string model;
  std::string prompt_file;
  std::string feed_file;
  int ngl = -1;
  int ncmoe = 0;
  std::string load_mode = "mmap";
  bool repack = false;
  int threads = 0;
  int batch = 2048;
  int ubatch = 512;
  std::string flash_attn = "auto";
  bool verbose = false;
};

[[noreturn]] void die(const std::string& message, int status = 1) {
  std::fprintf(stderr, "llama-feed: %s\n", message.c_str());
  std::exit(status);
}

[[noreturn]] void usage_error(const std::string& message) { die(message + " (see --help)", 2); }

int parse_int(const std::string& flag, const std::string& text, int lo) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno != 0 || v < lo || v > 1 << 30) {
    usage_error(flag + ": '" + text + "' is not a whole number >= " + std::to_string(lo));
  }
  return static_cast<int>(v);
}

Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (a == "-m" || a == "--model") {
      o.model = value();
    } else if (a == "--prompt-ids") {
      o.prompt_file = value();
    } else if (a == "--feed") {
      o.feed_file = value();
    } else if (a == "-ngl" || a == "--n-gpu-layers") {
      o.ngl = parse_int(a, value(), -1);
    } else if (a == "-ncmoe" || a == "--n-cpu-moe") {
      o.ncmoe = parse_int(a, value(), 0);
    } else if (a == "-lm" || a == "--load-mode") {
      o.load_mode = value();
      static const std::set<std::string> modes = {"auto",  "none",       "mmap",
                                                  "mlock", "mmap+mlock", "dio"};
      if (modes.count(o.load_mode) == 0) {
        usage_error(a + ": '" + o.load_mode +
                    "' is not auto, none, mmap, mlock, mmap+mlock or dio");
      }
    } else if (a == "--repack") {
      o.repack = true;
    } else if (a == "--no-repack") {
      o.repack = false;
    } else if (a == "-t" || a == "--threads") {
      o.threads = parse_int(a, value(), 1);
    } else if (a == "-b" || a == "--batch-size") {
      o.batch = parse_int(a, value(), 1);
    } else if (a == "-ub" || a == "--ubatch-size") {
      o.ubatch = parse_int(a, value(), 1);
    } else if (a == "-fa" || a == "--flash-attn") {
      o.flash_attn = value();
      if (o.flash_attn != "on" && o.flash_attn != "off" && o.flash_attn != "auto") {
        usage_error(a + ": '" + o.flash_attn + "' is not on, off or auto");
      }
    } else if (a == "--verbose") {
      o.verbose = true;
    } else {
      usage_error("unknown argument '" + a + "'");
    }
  }
  if (o.model.empty()) usage_error("-m MODEL is required");
  if (o.prompt_file.empty()) usage_error("--prompt-ids FILE is required");
  if (o.feed_file.empty()) usage_error("--feed FILE is required");
  return o;
}

// Ids separated by commas and/or whitespace. Errors name the file, the id's position (0-based,
// as an index into the stream) and the text.
std::vector<llama_token> read_ids(const std::string& flag, const std::string& path) {
  std::ifstream in(path);
  if (!in) die(flag + " " + path + ": " + std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  std::vector<llama_token> ids;
  size_t i = 0;
  while (i < text.size()) {
    const char c = text[i];
    if (c == ',' || c == ' ' || c == '\n' || c == '\r' || c == '\t') {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < text.size() && std::strchr(", \n\r\t", text[j]) == nullptr) ++j;
    const std::string item = text.substr(i, j - i);
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    if (*end != '\0' || errno != 0 || v < 0 || v > INT32_MAX) {
      die(flag + " " + path + ": the id at position " + std::to_string(ids.size()) +
          " (from 0) is '" + item + "', not a token id (a whole number >= 0)");
    }
    ids.push_back(static_cast<llama_token>(v));
    i = j;
  }
  return ids;
}

void check_vocab(const std::string& flag, const std::string& path,
                 const std::vector<llama_token>& ids, int32_t n_vocab) {
  for (size_t k = 0; k < ids.size(); ++k) {
    if (ids[k] >= n_vocab) {
      die(flag + " " + path + ": the id at position " + std::to_string(k) + " (from 0) is " +
          std::to_string(ids[k]) + ", not below the model's vocabulary size " +
          std::to_string(n_vocab));
    }
  }
}

struct IoCounters {
  uint64_t rchar = 0;       // bytes through read-like calls (page cache hits included)
  uint64_t read_bytes = 0;  // bytes this process made the kernel fetch from storage
};

IoCounters read_io() {
  IoCounters c;
  std::ifstream in("/proc/self/io");
  std::string key;
  uint64_t v = 0;
  while (in >> key >> v) {
    if (key == "rchar:") c.rchar = v;
    if (key == "read_bytes:") c.read_bytes = v;
  }
  return c;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Physical cores, as llama-bench's default -t counts them: distinct (package, core) pairs of the
// online CPUs; the logical CPUs when sysfs does not say.
int physical_cores() {
  std::set<std::pair<std::string, std::string>> cores;
  const unsigned n = std::thread::hardware_concurrency();
  for (unsigned cpu = 0; cpu < n; ++cpu) {
    const std::string base = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
    std::ifstream pkg(base + "physical_package_id");
    std::ifstream core(base + "core_id");
    std::string p;
    std::string c;
    if (!(pkg >> p) || !(core >> c)) return n > 0 ? static_cast<int>(n) : 4;
    cores.insert({p, c});
  }
  return cores.empty() ? 4 : static_cast<int>(cores.size());
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  // Nearest rank, as expert-run reports its stall percentiles.
  const size_t k = static_cast<size_t>(std::max(0.0, std::ceil(q * v.size()) - 1));
  return v[std::min(k, v.size() - 1)];
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

std::string number(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

// One JSON object on one line, keys in the order added; values already JSON text.
class JsonLine {
 public:
  void add(const std::string& key, const std::string& value) {
    text_ += (text_.empty() ? "{" : ",") + json_string(key) + ":" + value;
  }
  std::string done() const { return text_ + "}"; }

 private:
  std::string text_;
};

void quiet_log(ggml_log_level, const char*, void*) {}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse_args(argc, argv);
  const std::vector<llama_token> prompt = read_ids("--prompt-ids", o.prompt_file);
  const std::vector<llama_token> feed = read_ids("--feed", o.feed_file);
  if (feed.empty()) die("--feed " + o.feed_file + ": no ids");
  const int threads = o.threads > 0 ? o.threads : physical_cores();

  if (!o.verbose) llama_log_set(quiet_log, nullptr);
  ggml_backend_load_all();
  llama_backend_init();

  // The vocabulary alone first (the file's metadata, not its tensors): a bad id fails in a moment
  // rather than after reading the whole model.
  {
    llama_model_params vp = llama_model_default_params();
    vp.vocab_only = true;
    llama_model* vm = llama_model_load_from_file(o.model.c_str(), vp);
    if (vm == nullptr) die("-m " + o.model + ": llama.cpp cannot load it (--verbose says why)");
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(vm));
    check_vocab("--prompt-ids", o.prompt_file, prompt, n_vocab);
    check_vocab("--feed", o.feed_file, feed, n_vocab);
    llama_model_free(vm);
  }

  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = o.ngl;
  mp.load_mode = llama_load_mode_from_str(o.load_mode.c_str());
  mp.use_extra_bufts = o.repack;
  // -ncmoe: the routed-expert tensors of the first N blocks go to the CPU's buffer type; the
  // patterns are matched with std::regex_search against each tensor's name. The strings must
  // outlive the load (llama.cpp keeps the pointers).
  std::vector<std::string> patterns;
  std::vector<llama_model_tensor_buft_override> overrides;
  if (o.ncmoe > 0) {
    for (int i = 0; i < o.ncmoe; ++i) {
      patterns.push_back("^blk\\." + std::to_string(i) + "\\.ffn_(up|down|gate|gate_up)_(ch|)exps");
    }
    for (const std::string& p : patterns) {
      overrides.push_back({p.c_str(), ggml_backend_cpu_buffer_type()});
    }
    overrides.push_back({nullptr, nullptr});
    mp.tensor_buft_overrides = overrides.data();
  }

  const IoCounters io0 = read_io();
  const double t_load0 = now_s();
  llama_model* model = llama_model_load_from_file(o.model.c_str(), mp);
  if (model == nullptr) die("-m " + o.model + ": loading failed (--verbose says why)");
  const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

  llama_context_params cp = llama_context_default_params();
  // As llama-bench sizes a test's context: its tokens (here the longer of the two phases, which
  // never share the cache: the memory is cleared between them).
  cp.n_ctx = static_cast<uint32_t>(std::max(prompt.size(), feed.size()));
  cp.n_batch = static_cast<uint32_t>(o.batch);
  cp.n_ubatch = static_cast<uint32_t>(o.ubatch);
  cp.n_threads = threads;
  cp.n_threads_batch = threads;
  cp.flash_attn_type = o.flash_attn == "on"    ? LLAMA_FLASH_ATTN_TYPE_ENABLED
                       : o.flash_attn == "off" ? LLAMA_FLASH_ATTN_TYPE_DISABLED
                                               : LLAMA_FLASH_ATTN_TYPE_AUTO;
  cp.swa_full = false;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (ctx == nullptr) die("cannot create a context of " + std::to_string(cp.n_ctx) + " tokens");

  // A threadpool as llama-bench attaches one (polling threads kept between calls); without it
  // ggml starts threads for every graph, which would slow the one-token decodes it does not.
  ggml_threadpool_t pool = nullptr;
  void (*pool_free)(ggml_threadpool_t) = nullptr;
  if (ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)) {
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(cpu);
    auto* pool_new = reinterpret_cast<ggml_threadpool_t (*)(ggml_threadpool_params*)>(
        ggml_backend_reg_get_proc_address(reg, "ggml_threadpool_new"));
    pool_free = reinterpret_cast<void (*)(ggml_threadpool_t)>(
        ggml_backend_reg_get_proc_address(reg, "ggml_threadpool_free"));
    if (pool_new != nullptr && pool_free != nullptr) {
      ggml_threadpool_params tpp = ggml_threadpool_params_default(threads);
      pool = pool_new(&tpp);
      if (pool != nullptr) llama_attach_threadpool(ctx, pool, nullptr);
    }
  }
  llama_set_n_threads(ctx, threads, threads);
  const double load_s = now_s() - t_load0;
  const IoCounters io1 = read_io();

  // pp: the prompt in chunks of n_batch, synchronised once at the end (llama-bench's test_prompt).
  llama_memory_clear(llama_get_memory(ctx), false);
  std::vector<llama_token> chunk;
  const double t_pp0 = now_s();
  for (size_t done = 0; done < prompt.size();) {
    const size_t n = std::min(prompt.size() - done, static_cast<size_t>(o.batch));
    chunk.assign(prompt.begin() + static_cast<long>(done),
                 prompt.begin() + static_cast<long>(done + n));
    const int32_t rc =
        llama_decode(ctx, llama_batch_get_one(chunk.data(), static_cast<int32_t>(n)));
    if (rc != 0)
      die("prefill: llama_decode returned " + std::to_string(rc) + " at id " +
          std::to_string(done));
    done += n;
  }
  llama_synchronize(ctx);
  const double pp_s = now_s() - t_pp0;
  const IoCounters io2 = read_io();

  // tg: from an empty context, one llama_decode per id, each synchronised (llama-bench's
  // test_gen), each timed.
  llama_memory_clear(llama_get_memory(ctx), false);
  std::vector<double> ms;
  ms.reserve(feed.size());
  const double t_tg0 = now_s();
  for (size_t k = 0; k < feed.size(); ++k) {
    llama_token id = feed[k];
    const double t = now_s();
    const int32_t rc = llama_decode(ctx, llama_batch_get_one(&id, 1));
    if (rc != 0)
      die("decode: llama_decode returned " + std::to_string(rc) + " at feed id " +
          std::to_string(k));
    llama_synchronize(ctx);
    ms.push_back((now_s() - t) * 1e3);
  }
  const double tg_s = now_s() - t_tg0;
  const IoCounters io3 = read_io();

  llama_free(ctx);
  if (pool != nullptr) pool_free(pool);
  llama_model_free(model);
  llama_backend_free();

  const uint64_t pp_bytes = io2.read_bytes - io1.read_bytes;
  const uint64_t tg_bytes = io3.read_bytes - io2.read_bytes;
  const std::string commit = LLAMA_FEED_BUILD_COMMIT;
  std::string ms_list;
  for (const double m : ms) ms_list += (ms_list.empty() ? "" : ",") + number(m, 3);
  JsonLine j;
  j.add("tool", json_string("llama-feed"));
  j.add("model", json_string(o.model));
  j.add("n_vocab", std::to_string(n_vocab));
  j.add("load_s", number(load_s, 3));
  j.add("load_bytes_read", std::to_string(io1.read_bytes - io0.read_bytes));
  j.add("pp_tokens", std::to_string(prompt.size()));
  j.add("pp_tokens_per_s", number(pp_s > 0 && !prompt.empty() ? prompt.size() / pp_s : 0.0, 4));
  j.add("pp_bytes_read", std::to_string(pp_bytes));
  j.add("pp_rchar", std::to_string(io2.rchar - io1.rchar));
  j.add("tg_tokens", std::to_string(feed.size()));
  j.add("tg_tokens_per_s", number(tg_s > 0 ? feed.size() / tg_s : 0.0, 4));
  j.add("tg_ms_p50", number(percentile(ms, 0.5), 3));
  j.add("tg_ms_p99", number(percentile(ms, 0.99), 3));
  j.add("tg_ms", "[" + ms_list + "]");
  j.add("tg_bytes_read", std::to_string(tg_bytes));
  j.add("tg_bytes_read_per_token", number(static_cast<double>(tg_bytes) / feed.size(), 1));
  j.add("tg_rchar", std::to_string(io3.rchar - io2.rchar));
  j.add("ngl", std::to_string(o.ngl));
  j.add("ncmoe", std::to_string(o.ncmoe));
  j.add("load_mode", json_string(o.load_mode));
  j.add("repack", o.repack ? "true" : "false");
  j.add("n_threads", std::to_string(threads));
  j.add("n_batch", std::to_string(o.batch));
  j.add("n_ubatch", std::to_string(o.ubatch));
  j.add("flash_attn", json_string(o.flash_attn));
  j.add("prompt_file", json_string(o.prompt_file));
  j.add("feed_file", json_string(o.feed_file));
  if (!commit.empty()) j.add("build_commit", json_string(commit));
  std::puts(j.done().c_str());
  return std::fflush(stdout) == 0 ? 0 : 1;
}
