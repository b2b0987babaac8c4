// `expertctl metrics` against the real expertd: the text parses as Prometheus exposition format,
// every field of the schema's Stats (walked with Cap'n Proto's reflection, so a field added by
// anyone is checked without a line here) is exported, the numbers are the ones the client caused,
// and --output replaces the file atomically.
#include <capnp/schema.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "client/expertd.capnp.h"
#include "expertd/client.h"
#include "testing/expertctl_run.h"
#include "testing/expertd_fixture.h"

namespace expertd::client {
namespace {

using test::Daemon;
using test::TempDir;

struct Sample {
  std::map<std::string, std::string> labels;
  double value = 0;
};
struct Family {
  std::string type;
  std::string help;
  std::vector<Sample> samples;
};

// Parses the exposition, failing the test on anything the text format does not allow: a sample
// before its family's HELP and TYPE, a family split in two, a counter not named *_total, a bad
// label or value.
std::map<std::string, Family> parse(const std::string& text) {
  static const std::regex help(R"(^# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) (.*)$)");
  static const std::regex type(R"(^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge)$)");
  static const std::regex sample(
      R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (-?[0-9.e+]+|NaN|[+-]Inf)$)");
  static const std::regex label(R"re(([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)",?)re");
  std::map<std::string, Family> out;
  std::string current;
  std::istringstream in(text);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    std::smatch m;
    if (std::regex_match(line, m, help)) {
      EXPECT_EQ(out.count(m[1]), 0u) << "line " << n << ": family " << m[1] << " seen before";
      current = m[1];
      out[current].help = m[2];
    } else if (std::regex_match(line, m, type)) {
      EXPECT_EQ(m[1], current) << "line " << n << ": TYPE without its HELP";
      out[current].type = m[2];
      if (m[2] == "counter") {
        EXPECT_TRUE(current.ends_with("_total")) << current;
      }
    } else if (std::regex_match(line, m, sample)) {
      EXPECT_EQ(m[1], current) << "line " << n << ": a sample outside its family: " << line;
      EXPECT_FALSE(out[current].type.empty()) << "line " << n << ": no TYPE before " << line;
      Sample s;
      s.value = std::stod(m[4]);
      std::string rest = m[3];
      for (std::sregex_iterator it(rest.begin(), rest.end(), label), end; it != end; ++it) {
        EXPECT_TRUE(s.labels.emplace((*it)[1], (*it)[2]).second) << "line " << n << ": " << line;
      }
      out[current].samples.push_back(std::move(s));
    } else {
      ADD_FAILURE() << "line " << n << " is not exposition format: " << line;
    }
  }
  return out;
}

std::string snake(const std::string& camel) {
  std::string out;
  for (char c : camel) {
    if (c >= 'A' && c <= 'Z') {
      out += '_';
      out += static_cast<char>(c - 'A' + 'a');
    } else {
      out += c;
    }
  }
  return out;
}

// Where a field of the schema must show up: a family whose name ends in its snake name (units:
// Ms → _seconds) with `labels` labels on its samples, or, for text and identity fields, a label.
struct Expectation {
  std::string path;  // Stats.models.scheduler.acquires, for messages
  std::string name;  // snake, unit-converted
  size_t labels = 0;
  bool as_label = false;
};

// Walks the schema from Stats: every field that holds a value is an expectation. A list adds a
// label (its element's key or position); a nested struct adds nothing.
void expectations(capnp::StructSchema s, const std::string& path, size_t labels, bool element,
                  std::vector<Expectation>& out) {
  static const std::set<std::string> kIdentity = {"name", "session", "depth", "pid", "uid"};
  for (const auto field : s.getFields()) {
    const std::string camel = field.getProto().getName().cStr();
    const std::string p = path + "." + camel;
    auto type = field.getType();
    if (type.isStruct()) {
      expectations(type.asStruct(), p, labels, false, out);
      continue;
    }
    if (type.isList()) {
      const auto e = type.asList().getElementType();
      if (e.isStruct()) {
        expectations(e.asStruct(), p, labels + 1, true, out);
      } else {
        out.push_back({p, snake(camel), labels + 1, false});
      }
      continue;
    }
    std::string name = snake(camel);
    if (name.ends_with("_ms")) name = name.substr(0, name.size() - 3) + "_seconds";
    const bool label = type.isText() || (element && kIdentity.count(name) > 0);
    out.push_back({p, name == "name" ? "model" : name, labels, label});
  }
}

class MetricsTest : public test::ForgedDaemonTest {};

TEST_F(MetricsTest, EveryStatsFieldIsExportedWithTheNumbersTheClientCaused) {
  auto c = Client::connect(daemon_->socket());
  ASSERT_TRUE(c) << c.error().message;
  auto s = (*c)->attach("m", "metrics \"test\"");  // a quote: the label must escape it
  ASSERT_TRUE(s) << s.error().message;
  // Hints (so every list of prefetch depths is filled), 3 acquires of 2 experts, one batch held.
  ASSERT_TRUE((*s)->set_cursor(0, 0));
  const PrefetchHint hints[] = {{1, 3, 0.9f}, {2, 4, 0.8f}};
  ASSERT_TRUE((*s)->prefetch(hints));
  const uint32_t experts[] = {0, 1};
  for (uint32_t layer = 0; layer < 2; ++layer) {
    auto v = (*s)->acquire(layer, experts);
    ASSERT_TRUE(v) << v.error().message;
    ASSERT_TRUE((*s)->release(*v));
  }
  auto held = (*s)->acquire(3, experts);
  ASSERT_TRUE(held) << held.error().message;

  const auto r = test::expertctl(daemon_->socket(), {"metrics"});
  ASSERT_EQ(r.status, 0) << r.err;
  const auto families = parse(r.out);

  std::vector<Expectation> want;
  expectations(capnp::Schema::from<rpc::Stats>(), "Stats", 0, false, want);
  ASSERT_GT(want.size(), 40u);
  for (const auto& w : want) {
    bool found = false;
    for (const auto& [name, f] : families) {
      for (const auto& smp : f.samples) {
        if (w.as_label) {
          found = found || smp.labels.count(w.name) > 0;
        } else {
          const bool named =
              name.ends_with("_" + w.name) || name.ends_with("_" + w.name + "_total");
          found = found || (named && smp.labels.size() == w.labels);
        }
      }
    }
    EXPECT_TRUE(found) << w.path << " is not exported (expected "
                       << (w.as_label ? "a label " : "a metric *_") << w.name << " with "
                       << w.labels << " labels); the schema's field needs a rule in "
                       << "tools/expertctl/metrics.cc, or the test's daemon never filled its list";
  }

  auto value = [&](const std::string& family, const std::map<std::string, std::string>& labels) {
    const auto it = families.find(family);
    if (it == families.end()) return -1.0;
    for (const auto& smp : it->second.samples) {
      bool match = true;
      for (const auto& [k, v] : labels)
        match = match && smp.labels.count(k) && smp.labels.at(k) == v;
      if (match) return smp.value;
    }
    return -1.0;
  };
  const std::string sid = std::to_string((*s)->id());
  EXPECT_EQ(value("expertd_model_acquires_total", {{"model", "m"}}), 6);
  EXPECT_EQ(value("expertd_session_acquires_total", {{"session", sid}}), 6);
  EXPECT_EQ(value("expertd_session_holds", {{"session", sid}}), 2);
  EXPECT_EQ(value("expertd_model_layer_hits_total", {{"model", "m"}, {"layer", "3"}}) +
                value("expertd_model_layer_misses_total", {{"model", "m"}, {"layer", "3"}}),
            2);
  EXPECT_EQ(value("expertd_session_info", {{"session", sid}, {"client", R"(metrics \"test\")"}}),
            1);
  EXPECT_EQ(value("expertd_model_prefetch_depth_hints_total", {{"model", "m"}, {"depth", "1"}}) +
                value("expertd_model_prefetch_depth_hints_total", {{"model", "m"}, {"depth", "2"}}),
            2);
  EXPECT_EQ(families.at("expertd_model_acquires_total").type, "counter");
  EXPECT_EQ(families.at("expertd_model_cache_slots").type, "gauge");
  EXPECT_EQ(families.at("expertd_model_acquires_total").help, "acquires of an expert");
  EXPECT_TRUE((*s)->release(*held));
}

std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      if (e->d_name[0] != '.') out.push_back(e->d_name);
    }
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST_F(MetricsTest, OutputReplacesTheFileAtomicallyAndNamesAPathItCannotWrite) {
  const std::string dir = dir_.path() + "/textfile";
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  const std::string file = dir + "/expertd.prom";
  for (int i = 0; i < 2; ++i) {  // the second run replaces the first file
    const auto r = test::expertctl(daemon_->socket(), {"metrics", "--output", file});
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_EQ(r.out, "");
    const auto families = parse(test::read_file(file));
    EXPECT_TRUE(families.count("expertd_model_acquires_total"));
    EXPECT_EQ(files_in(dir), std::vector<std::string>{"expertd.prom"});  // no temporary left
  }
  const auto bad = test::expertctl(daemon_->socket(), {"metrics", "--output", dir + "/no/x.prom"});
  EXPECT_EQ(bad.status, 1);
  EXPECT_NE(bad.err.find("expertctl metrics: cannot create " + dir + "/no/x.prom.tmp."),
            std::string::npos)
      << bad.err;
  const auto gone = test::expertctl(dir_.path() + "/nobody.sock", {"metrics"});
  EXPECT_EQ(gone.status, 1);
  EXPECT_NE(gone.err.find("cannot connect to expertd"), std::string::npos) << gone.err;
}

}  // namespace
}  // namespace expertd::client
