// muonmeshctl end to end: the real muonmesh-coordinator as a child process
// on 127.0.0.1:0 and the real muonmeshctl binary, checked by exit code and
// output. Every wait is bounded.

#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "muonmesh/v1/config.pb.h"
#include "muonmesh/v1/planner.pb.h"
#include "tests/testing/model_specs.h"
#include "tests/testing/subprocess.h"

namespace muonmesh {
namespace {

using ::muonmesh::testing::ProcessResult;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr std::chrono::seconds kCallBound(60);

std::string Gpt2Spec() { return std::string(MUONMESH_SPECS_DIR) + "/gpt2-124m.json"; }


// In a folder every test process shares (ctest runs each test as a process
// of its own, two at a time): the pid keeps two tests writing the same name
// from reading each other's half-written file.
std::string WriteTempFile(const std::string& name, const std::string& text) {
  const std::string path =
      ::testing::TempDir() + "/muonmeshctl_test_" + std::to_string(::getpid()) + "_" + name;
  std::ofstream(path) << text;
  return path;
}

// A strict RFC 8259 syntax check: enough to know a JSON output parses.
class JsonChecker {
 public:
  explicit JsonChecker(std::string_view text) : s_(text) {}

  bool Valid() {
    Space();
    if (!Value(0)) return false;
    Space();
    return i_ == s_.size();
  }

 private:
  bool Value(int depth) {
    if (i_ >= s_.size() || depth > 64) return false;
    switch (s_[i_]) {
      case '{':
        return Object(depth);
      case '[':
        return Array(depth);
      case '"':
        return String();
      case 't':
        return Literal("true");
      case 'f':
        return Literal("false");
      case 'n':
        return Literal("null");
      default:
        return Number();
    }
  }
  bool Object(int depth) {
    ++i_;
    Space();
    if (Eat('}')) return true;
    while (true) {
      Space();
      if (!String()) return false;
      Space();
      if (!Eat(':')) return false;
      Space();
      if (!Value(depth + 1)) return false;
      Space();
      if (Eat('}')) return true;
      if (!Eat(',')) return false;
    }
  }
  bool Array(int depth) {
    ++i_;
    Space();
    if (Eat(']')) return true;
    while (true) {
      Space();
      if (!Value(depth + 1)) return false;
      Space();
      if (Eat(']')) return true;
      if (!Eat(',')) return false;
    }
  }
  bool String() {
    if (!Eat('"')) return false;
    while (i_ < s_.size()) {
      const char c = s_[i_++];
      if (c == '"') return true;
      if (static_cast<unsigned char>(c) < 0x20) return false;
      if (c == '\\') {
        if (i_ >= s_.size()) return false;
        const char e = s_[i_++];
        if (e == 'u') {
          for (int k = 0; k < 4; ++k) {
            if (i_ >= s_.size() || !std::isxdigit(static_cast<unsigned char>(s_[i_++]))) {
              return false;
            }
          }
        } else if (std::string_view("\"\\/bfnrt").find(e) == std::string_view::npos) {
          return false;
        }
      }
    }
    return false;
  }
  bool Number() {
    Eat('-');
    if (Eat('0')) {
    } else if (!Digits()) {
      return false;
    }
    if (Eat('.') && !Digits()) return false;
    if (Eat('e') || Eat('E')) {
      if (!Eat('+')) Eat('-');
      if (!Digits()) return false;
    }
    return true;
  }
  bool Digits() {
    const size_t start = i_;
    while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) ++i_;
    return i_ > start;
  }
  bool Literal(std::string_view word) {
    if (s_.substr(i_, word.size()) != word) return false;
    i_ += word.size();
    return true;
  }
  bool Eat(char c) {
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  void Space() {
    while (i_ < s_.size() && std::string_view(" \t\r\n").find(s_[i_]) != std::string_view::npos) {
      ++i_;
    }
  }

  std::string_view s_;
  size_t i_ = 0;
};

// A loopback port nobody listens on (bound, then released).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

// CPU seconds (user + system) that process `pid` has used so far, from
// /proc/PID/stat; -1 when it cannot be read.
double CpuSeconds(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // Fields after the command name (which may hold spaces), from field 3 on.
  const size_t close_paren = stat.rfind(')');
  if (close_paren == std::string::npos) return -1;
  std::vector<std::string> fields = absl::StrSplit(stat.substr(close_paren + 2), ' ');
  int64_t utime = 0;
  int64_t stime = 0;
  // utime and stime are fields 14 and 15 of the line: 11 and 12 after it.
  if (fields.size() < 13 || !absl::SimpleAtoi(fields[11], &utime) ||
      !absl::SimpleAtoi(fields[12], &stime)) {
    return -1;
  }
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// Peak resident memory of process `pid` (VmHWM in /proc/PID/status) in
// bytes; -1 when it cannot be read.
int64_t PeakRssBytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (!absl::StartsWith(line, "VmHWM:")) continue;
    int64_t kb = 0;
    std::string value(absl::StripAsciiWhitespace(line.substr(6)));
    value = value.substr(0, value.find(' '));
    return absl::SimpleAtoi(value, &kb) ? kb * 1024 : -1;
  }
  return -1;
}

// A spec of `units` layers of `per_unit` [rows, cols] Muon matrices, as JSON.
std::string LayersSpec(int units, int per_unit, int64_t rows, int64_t cols) {
  std::string json = "{\"name\": \"layers\", \"units\": [";
  for (int u = 0; u < units; ++u) {
    absl::StrAppend(&json, u == 0 ? "" : ",", "\n{\"name\": \"u", u, "\", \"params\": [");
    for (int k = 0; k < per_unit; ++k) {
      absl::StrAppend(&json, k == 0 ? "" : ", ", "{\"name\": \"u", u, ".w", k,
                      "\", \"shape\": [", rows, ", ", cols, "], \"optimizer\": \"muon\"}");
    }
    json += "]}";
  }
  return json + "]}\n";
}

// Waits (bounded) until process `pid` has used `seconds` more CPU than
// `since`; false if it never does.
bool WaitForCpu(pid_t pid, double since, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(180);
  while (std::chrono::steady_clock::now() < deadline) {
    if (CpuSeconds(pid) >= since + seconds) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

class MuonmeshCtlTest : public ::testing::Test {
 protected:
  void SetUp() override { StartCoordinator({}); }

  // Starts the coordinator on 127.0.0.1:0 with `flags`, stopping the one
  // running (if any) first.
  void StartCoordinator(const std::vector<std::string>& flags) {
    if (coordinator_ > 0) StopCoordinator(SIGTERM);
    if (coordinator_out_ >= 0) close(coordinator_out_);
    int out_pipe[2];
    ASSERT_EQ(pipe2(out_pipe, O_CLOEXEC), 0);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out_pipe[1], STDOUT_FILENO);
    std::vector<std::string> argv = {MUONMESH_COORDINATOR_BIN, "--listen", "127.0.0.1:0",
                                     "--data-dir", "none"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    const int err = posix_spawn(&coordinator_, argv[0].c_str(), &actions, nullptr,
                                testing::CStrings(argv).data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    close(out_pipe[1]);
    coordinator_out_ = out_pipe[0];
    ASSERT_EQ(err, 0) << std::strerror(err);

    // Wait (bounded) for "muonmesh-coordinator listening on HOST:PORT\n".
    std::string line;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (line.find('\n') == std::string::npos && std::chrono::steady_clock::now() < deadline) {
      pollfd fd{coordinator_out_, POLLIN, 0};
      if (poll(&fd, 1, 100) <= 0) continue;
      char buf[256];
      const ssize_t n = read(coordinator_out_, buf, sizeof buf);
      if (n <= 0) break;
      line.append(buf, static_cast<size_t>(n));
    }
    const std::string kReady = "muonmesh-coordinator listening on ";
    ASSERT_TRUE(absl::StartsWith(line, kReady)) << "coordinator said: '" << line << "'";
    address_ = line.substr(kReady.size(), line.find('\n') - kReady.size());
    int port = 0;
    ASSERT_TRUE(absl::SimpleAtoi(address_.substr(address_.rfind(':') + 1), &port)) << address_;
    ASSERT_GT(port, 0);
    EXPECT_TRUE(absl::StartsWith(address_, "127.0.0.1:")) << address_;
  }

  void TearDown() override {
    if (coordinator_ > 0) StopCoordinator(SIGTERM);
    if (coordinator_out_ >= 0) close(coordinator_out_);
    coordinator_out_ = -1;
  }

  // Sends `signal` and expects a clean, prompt exit.
  void StopCoordinator(int signal) {
    kill(coordinator_, signal);
    bool timed_out = false;
    const int code = testing::WaitOrKill(
        coordinator_, std::chrono::steady_clock::now() + std::chrono::seconds(20), &timed_out);
    coordinator_ = -1;
    EXPECT_FALSE(timed_out) << "coordinator ignored signal " << signal;
    EXPECT_EQ(code, 0);
  }

  ProcessResult Ctl(std::vector<std::string> args, const std::vector<std::string>& env = {}) {
    args.insert(args.begin(), MUONMESHCTL_BIN);
    return testing::Run(std::move(args), kCallBound, env);
  }

  // `plan`/`validate` on gpt2-124m against our coordinator, plus `more`.
  ProcessResult Gpt2(const std::string& command, const std::string& world_size,
                     std::vector<std::string> more = {}) {
    std::vector<std::string> args = {command,    "--spec",        Gpt2Spec(), "--world-size",
                                     world_size, "--coordinator", address_};
    args.insert(args.end(), more.begin(), more.end());
    return Ctl(std::move(args));
  }

  pid_t coordinator_ = -1;
  int coordinator_out_ = -1;
  std::string address_;
};

#define REQUIRE_GPT2() ASSERT_TRUE(muonmesh::testing::ModelSpecExists(Gpt2Spec()))

TEST_F(MuonmeshCtlTest, PlanJsonIsByteIdenticalAcrossRuns) {
  REQUIRE_GPT2();
  const ProcessResult a = Gpt2("plan", "8", {"--json"});
  const ProcessResult b = Gpt2("plan", "8", {"--json"});
  ASSERT_EQ(a.exit_code, 0) << a.err;
  ASSERT_EQ(b.exit_code, 0) << b.err;
  EXPECT_FALSE(a.out.empty());
  EXPECT_TRUE(a.out == b.out) << "outputs differ";  // not EXPECT_EQ: megabytes of diff
  EXPECT_EQ(a.err, "");
}

TEST_F(MuonmeshCtlTest, PlanJsonHasTheDocumentedKeys) {
  REQUIRE_GPT2();
  const ProcessResult r = Gpt2("plan", "8", {"--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(JsonChecker(r.out).Valid());
  for (const char* key :
       {"\"world_size\": 8,", "\"matrices\": [",        "\"name\": \"h.0.attn.c_attn.weight\"",
        "\"rows\": 2304,",    "\"cols\": 768,",         "\"domain\": 0,",
        "\"owner\": ",        "\"cost_flops\": ",       "\"holders\": [",
        "\"row_start\": 0,",  "\"row_count\": ",        "\"ranks\": [",
        "\"rank\": 0,",       "\"load_flops\": ",       "\"shard_elements\": ",
        "\"summary\": {",     "\"padding_fraction\": ", "\"makespan_over_lower_bound\": ",
        "\"dim_names\": [",   "\"placements\": [",   "\"joint_makespan\": ",
        "\"joint_lower_bound\": "}) {
    EXPECT_TRUE(absl::StrContains(r.out, key)) << key;  // not HasSubstr: 100 KiB of output
  }
  // A timing would break byte-identical output.
  EXPECT_FALSE(absl::StrContains(r.out, "plan_seconds"));
  // int64 fields are numbers, never strings.
  EXPECT_TRUE(absl::StrContains(r.out, "\"parameters\": 124439808,"));
}

// With a wave budget of one byte every block is a wave of its own (a unit
// over the budget alone makes one); on 8 ranks each block's four matrices
// go to four ranks, so each wave's busiest rank runs the block's largest
// matrix, 768 x 3072: T (4 m^2 n + 2 m^3) with m = 768, n = 3072, T = 5.
TEST_F(MuonmeshCtlTest, PlanWithAWaveBudgetReportsTheWaves) {
  REQUIRE_GPT2();
  const std::vector<std::string> flags = {"--device", "cpu", "--ns-algorithm", "standard",
                                          "--muon-wave-budget-bytes", "1"};
  std::vector<std::string> json = flags;
  json.push_back("--json");
  const ProcessResult r = Gpt2("plan", "8", json);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(absl::StrContains(r.out, "\"muon_waves\": 12,"));
  const std::string key = "\"wave_critical_path_ns_flops\": ";
  const size_t at = r.out.find(key);
  ASSERT_NE(at, std::string::npos);
  const double path = std::strtod(r.out.c_str() + at + key.size(), nullptr);
  const double m = 768, n = 3072;
  EXPECT_NEAR(path, 12 * 5 * (4 * m * m * n + 2 * m * m * m), 1e-9 * path);
  const ProcessResult table = Gpt2("plan", "8", flags);
  ASSERT_EQ(table.exit_code, 0) << table.err;
  EXPECT_THAT(table.out, HasSubstr("Muon waves"));
  // Without a budget: one wave, and no such row.
  const ProcessResult plain = Gpt2("plan", "8", {"--device", "cpu"});
  EXPECT_THAT(plain.out, Not(HasSubstr("Muon waves")));
}

TEST_F(MuonmeshCtlTest, PlanTableShowsMeshPlacementsAndPadding) {
  REQUIRE_GPT2();
  const ProcessResult r = Gpt2("plan", "8", {"--instances", "2", "--outer-strategy", "optim"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* text :
       {"gpt2-124m", "dense mesh", "(dp_outer=2, dp_shard=4)", "HFSDP", "Partial(avg)", "padding",
        "Muon makespan", "Muon critical path", "Muon exchange", "param_allgather",
        "most loaded"}) {
    EXPECT_THAT(r.out, HasSubstr(text));
  }
}

// Which Newton-Schulz form each matrix runs, in the JSON and counted in the
// table: on the CPU, auto takes the Gram form exactly where the long side
// exceeds 1.5 x the short one (at 5 quintic iterations, README); on cuda
// every matrix runs the standard form for now.
TEST_F(MuonmeshCtlTest, PlanSaysWhichNewtonSchulzFormEachMatrixRuns) {
  REQUIRE_GPT2();
  const ProcessResult json = Gpt2("plan", "8", {"--device", "cpu", "--json"});
  ASSERT_EQ(json.exit_code, 0) << json.err;
  v1::Plan plan;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json.out, &plan, options).ok());
  ASSERT_GT(plan.matrices_size(), 0);
  // At 5 quintic iterations on one thread: standard 20 m^2 n + 10 m^3 counted
  // FLOPs, the Gram iteration 8 m^2 n + 28 m^3, the spectral form
  // 6 m^2 n + 30 m^3 + 3000 m^2 (plan/ns_cost.h); the cheapest runs, ties to
  // standard, then gram. GPT-2: 768 x 768 standard, 768 x 2304 and 768 x 3072
  // spectral (52 - 1.18 and 60 - 3.18 m^3 against the Gram form).
  std::map<std::string, std::set<std::string>> by_form;
  for (const v1::Matrix& m : plan.matrices()) {
    const double lo = static_cast<double>(std::min(m.rows(), m.cols()));
    const double hi = static_cast<double>(std::max(m.rows(), m.cols()));
    const double standard = 20 * lo * lo * hi + 10 * lo * lo * lo;
    const double gram = 8 * lo * lo * hi + 28 * lo * lo * lo;
    const double spectral = 6 * lo * lo * hi + 30 * lo * lo * lo + 3000 * lo * lo;
    const char* want = "standard";
    double best = standard;
    if (gram < best) want = "gram", best = gram;
    if (spectral < best) want = "spectral";
    EXPECT_EQ(m.ns_form(), want) << m.name();
    by_form[want].insert(m.name());
  }
  EXPECT_FALSE(by_form["spectral"].empty());
  EXPECT_FALSE(by_form["standard"].empty());
  size_t named = 0;
  std::vector<std::string> counts;
  for (const auto& [form, names] : by_form) {
    if (names.empty()) continue;
    counts.push_back(absl::StrCat(form, " on ", names.size(), " matrices"));
    named += names.size();
  }
  const ProcessResult table = Gpt2("plan", "8", {"--device", "cpu"});
  ASSERT_EQ(table.exit_code, 0) << table.err;
  EXPECT_THAT(table.out, HasSubstr(absl::StrCat("5 quintic iterations, auto: ",
                                                absl::StrJoin(counts, ", "), "\n")));
  const ProcessResult cuda = Gpt2("plan", "8", {"--ns-coefficients", "polar_express"});
  ASSERT_EQ(cuda.exit_code, 0) << cuda.err;
  EXPECT_THAT(cuda.out,
              HasSubstr(absl::StrCat("5 polar_express iterations, standard: standard on ",
                                     named, " matrices\n")));
}

// --threads-per-rank prices the spectral form's eigensolver for ranks of
// that many OpenBLAS threads (plan/ns_cost.h): on two, the Gram iteration
// (8 m^2 n + 28 m^3) beats the spectral form
// (6 m^2 n + 50.14 m^3 + 3000 * 1.754 m^2) up to n / m = 14.4 at m = 768 and
// the standard one (20 m^2 n + 10 m^3) beyond n / m = 1.5;
// out of range is refused naming the field.
TEST_F(MuonmeshCtlTest, PlanPricesTheFormsForTheThreadsPerRank) {
  REQUIRE_GPT2();
  const ProcessResult json =
      Gpt2("plan", "8", {"--device", "cpu", "--threads-per-rank", "2", "--json"});
  ASSERT_EQ(json.exit_code, 0) << json.err;
  v1::Plan plan;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json.out, &plan, options).ok());
  EXPECT_EQ(plan.summary().threads_per_rank(), 2);
  std::map<std::string, std::set<std::string>> by_form;
  for (const v1::Matrix& m : plan.matrices()) {
    const double lo = static_cast<double>(std::min(m.rows(), m.cols()));
    const double hi = static_cast<double>(std::max(m.rows(), m.cols()));
    const double slowdown = 2 / 1.14;
    const double spectral = 6 * hi + 30 * (0.11 + 0.89 * slowdown) * lo + 3000 * slowdown;  // / m^2
    const char* want =
        spectral < 8 * hi + 28 * lo ? "spectral" : (hi > 1.5 * lo ? "gram" : "standard");
    EXPECT_EQ(m.ns_form(), want) << m.name();
    by_form[want].insert(m.name());
  }
  EXPECT_FALSE(by_form["gram"].empty());
  const ProcessResult table = Gpt2("plan", "8", {"--device", "cpu", "--threads-per-rank", "2"});
  ASSERT_EQ(table.exit_code, 0) << table.err;
  EXPECT_THAT(table.out, HasSubstr(absl::StrCat(
                             "auto (priced for 2 threads a rank): gram on ",
                             by_form["gram"].size(), " matrices, standard on ",
                             by_form["standard"].size(), " matrices\n")));
  const ProcessResult bad = Gpt2("plan", "8", {"--device", "cpu", "--threads-per-rank", "300"});
  EXPECT_EQ(bad.exit_code, 1) << bad.err;
  EXPECT_THAT(bad.err, HasSubstr("options.threads_per_rank"));
  EXPECT_THAT(bad.err, HasSubstr("got 300"));
}

TEST_F(MuonmeshCtlTest, PlanTableOfABigWorldShowsTheExtremes) {
  REQUIRE_GPT2();
  const ProcessResult r = Gpt2("plan", "64");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("showing the 8 most loaded and the 4 least loaded of 64 ranks"));
  EXPECT_THAT(r.out, HasSubstr("52 ranks not shown"));
}

TEST_F(MuonmeshCtlTest, ValidateOfAnInvalidConfigExits1WithTheField) {
  REQUIRE_GPT2();
  const ProcessResult r = Gpt2("validate", "8", {"--instances", "3"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("parallelism.num_distributed_optimizer_instances: 3 does not "
                               "divide world_size 8\n"));
  EXPECT_EQ(r.out, "");
}

TEST_F(MuonmeshCtlTest, PlanOfAnInvalidConfigExits1WithEveryField) {
  REQUIRE_GPT2();
  const ProcessResult r =
      Gpt2("plan", "8", {"--instances", "3", "--strategy", "zero9", "--ns-steps", "-5"});
  EXPECT_EQ(r.exit_code, 1);
  // One violation per line, field first.
  EXPECT_THAT(r.err, HasSubstr("parallelism.num_distributed_optimizer_instances: "));
  EXPECT_THAT(r.err, ::testing::AnyOf(
                         HasSubstr("\nparallelism.data_parallel_sharding_strategy: "),
                         ::testing::StartsWith("parallelism.data_parallel_sharding_strategy: ")));
  EXPECT_THAT(r.err, HasSubstr("options.ns_steps: "));
  EXPECT_EQ(r.out, "");
}

TEST_F(MuonmeshCtlTest, ValidConfigValidates) {
  REQUIRE_GPT2();
  const ProcessResult r = Gpt2("validate", "8", {"--instances", "2"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("valid"));
}

TEST_F(MuonmeshCtlTest, CoordinatorAddressFromTheEnvironment) {
  REQUIRE_GPT2();
  const ProcessResult r = Ctl({"validate", "--spec", Gpt2Spec(), "--world-size", "8"},
                              {"MUONMESH_COORDINATOR=" + address_});
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

TEST_F(MuonmeshCtlTest, MalformedSpecExits2WithItsLocationWithoutCallingTheServer) {
  // The bracket on line 3 closes a mapping that is still open.
  const std::string path = WriteTempFile("malformed.json",
                                         "{\n"
                                         "  \"name\": \"bad\",\n"
                                         "  \"units\": [ {\"name\": \"u\" ]\n"
                                         "}\n");
  // A port nobody listens on: contacting it would exit 3, not 2.
  const std::string nobody = absl::StrCat("127.0.0.1:", FreePort());
  const ProcessResult r =
      Ctl({"plan", "--spec", path, "--world-size", "8", "--coordinator", nobody});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(absl::StartsWith(r.err, path + ":3:")) << r.err;
  EXPECT_THAT(r.err, Not(HasSubstr(nobody)));
}

TEST_F(MuonmeshCtlTest, UnknownFieldInSpecIsNamed) {
  const std::string path =
      WriteTempFile("unknown_field.yaml",
                    "name: tiny\n"
                    "units:\n"
                    "  - name: u\n"
                    "    params:\n"
                    "      - {name: w, shape: [4, 4], optimizer: muon, learning_rate: 1}\n");
  const ProcessResult r =
      Ctl({"validate", "--spec", path, "--world-size", "2", "--coordinator", address_});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(absl::StartsWith(r.err, path + ":5:")) << r.err;
  EXPECT_THAT(r.err, HasSubstr("learning_rate"));
}

TEST_F(MuonmeshCtlTest, MissingSpecFileExits2) {
  const ProcessResult r = Ctl({"plan", "--spec", ::testing::TempDir() + "/no/such/spec.json",
                               "--world-size", "8", "--coordinator", address_});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("no/such/spec.json"));
}

TEST_F(MuonmeshCtlTest, RefusedCoordinatorExits3NamingTheAddress) {
  REQUIRE_GPT2();
  const std::string nobody = absl::StrCat("127.0.0.1:", FreePort());
  const ProcessResult r = Ctl({"plan", "--spec", Gpt2Spec(), "--world-size", "8", "--coordinator",
                               nobody, "--timeout", "10"});
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_THAT(r.err, HasSubstr(nobody));
  EXPECT_LT(r.seconds, 10);
}

// A coordinator that accepts connections and never answers: the call ends at
// its deadline, not at gRPC's own (much longer) connect timeouts.
TEST_F(MuonmeshCtlTest, SilentCoordinatorExits4AtTheDeadline) {
  REQUIRE_GPT2();
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(listen(fd, 4), 0);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string silent = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
  const ProcessResult r = Ctl({"validate", "--spec", Gpt2Spec(), "--world-size", "8",
                               "--coordinator", silent, "--timeout", "2"});
  close(fd);
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_THAT(r.err, HasSubstr(silent));
  EXPECT_GE(r.seconds, 1.5);
  EXPECT_LT(r.seconds, 15);
}

TEST_F(MuonmeshCtlTest, UsageErrorsExit2NamingTheFlag) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"plan", "--bogus", "1"}, "unknown flag --bogus"},
      {{"plan", "--spec", "x.json", "--world-size", "eight"},
       "--world-size: 'eight' is not an integer"},
      {{"validate", "--world-size", "8", "--spec"}, "--spec needs a value"},
      {{"validate", "--spec", "--json"}, "--spec needs a value"},
      {{"plan", "--spec", "x.json"}, "missing required flag --world-size"},
      {{"plan", "--spec", "x.json", "--world-size", "8", "--timeout", "0"}, "--timeout"},
      {{"plan", "--spec", "x.json", "--world-size", "8", "--ns-steps", "99999999999"},
       "--ns-steps"},
      {{"plan", "--json=yes"}, "--json takes no value"},
      {{"plan", "stray"}, "unexpected argument 'stray'"},
      // proto3 cannot tell 0 from unset: an explicit 0 would silently mean
      // the default.
      {{"plan", "--spec", "x.json", "--world-size", "8", "--instances", "0"},
       "--instances: must be >= 1, got 0 (omit --instances for the default, 1)"},
      {{"validate", "--spec", "x.json", "--world-size", "8", "--ep=0"},
       "--ep: must be >= 1, got 0 (omit --ep for the default, 1)"},
      {{"plan", "--spec", "x.json", "--world-size", "8", "--ns-steps", "0"},
       "--ns-steps: must be >= 1, got 0 (omit --ns-steps for the default, 5)"},
      {{"frobnicate"}, "unknown command 'frobnicate'"},
      {{}, "Usage: muonmeshctl"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat("args: ", c.args.empty() ? "(none)" : c.args[0], " ...", c.message));
    const ProcessResult r = Ctl(c.args);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.message));
  }
}

TEST_F(MuonmeshCtlTest, HelpExits0) {
  const ProcessResult help = Ctl({"help"});
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_THAT(help.out, HasSubstr("validate"));
  EXPECT_THAT(help.out, HasSubstr("plan"));
  for (const char* code : {"0  ok", "1  invalid config", "2  usage error", "3  coordinator unreachable",
                           "4  deadline", "5  refused or failed"}) {
    EXPECT_THAT(help.out, HasSubstr(code));
  }
  const ProcessResult plan_help = Ctl({"plan", "--help"});
  EXPECT_EQ(plan_help.exit_code, 0);
  for (const char* flag : {"--spec FILE", "--world-size W", "--owner-rule R", "--ns-steps T",
                           "--include-shards", "--timeout SECONDS", "--json"}) {
    EXPECT_THAT(plan_help.out, HasSubstr(flag));
  }
  EXPECT_THAT(plan_help.out, HasSubstr("Exit codes:"));
  const ProcessResult validate_help = Ctl({"validate", "-h"});
  EXPECT_EQ(validate_help.exit_code, 0);
  EXPECT_THAT(validate_help.out, HasSubstr("--instances I"));
  EXPECT_THAT(validate_help.out, HasSubstr("4  deadline"));
}

TEST_F(MuonmeshCtlTest, CoordinatorHelpAndBadFlags) {
  const ProcessResult help = testing::Run({MUONMESH_COORDINATOR_BIN, "--help"}, kCallBound);
  EXPECT_EQ(help.exit_code, 0) << help.err;
  for (const char* flag :
       {"--listen", "--shutdown-grace", "--max-concurrent-plans", "--plan-memory-mib",
        "--data-dir", "--metrics-listen", "--lease-ttl", "--partition-grace",
        "--collective-timeout"}) {
    EXPECT_THAT(help.out, HasSubstr(flag));
  }
  // Either spelling of a name reaches the flag; errors name it with dashes.
  for (const char* bad : {"--max_concurrent_plans=0", "--max-concurrent-plans=0",
                          "--plan-memory-mib=-1", "--lease-ttl=1ms", "--partition-grace=2h",
                          "--allowed-dirs=/nonexistent-muonmesh-folder"}) {
    const ProcessResult r = testing::Run({MUONMESH_COORDINATOR_BIN, bad}, kCallBound);
    EXPECT_EQ(r.exit_code, 2) << bad;
    std::string name = std::string(bad).substr(0, std::string(bad).find('='));
    std::replace(name.begin(), name.end(), '_', '-');
    EXPECT_THAT(r.err, HasSubstr(name)) << bad;
  }
  const ProcessResult unknown =
      testing::Run({MUONMESH_COORDINATOR_BIN, "--data-dri", "/tmp"}, kCallBound);
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_THAT(unknown.err, HasSubstr("unknown flag --data-dri"));
  // The port our fixture's coordinator holds cannot be taken twice.
  const ProcessResult taken =
      testing::Run({MUONMESH_COORDINATOR_BIN, "--listen", address_, "--data-dir", "none"},
                   kCallBound);
  EXPECT_EQ(taken.exit_code, 1);
  EXPECT_THAT(taken.err, HasSubstr("cannot listen on " + address_));
}

TEST_F(MuonmeshCtlTest, EmptyOrNullSpecIsAFileError) {
  for (const auto& [name, text] : {std::pair{"empty.yaml", ""}, std::pair{"null.yaml", "null\n"},
                                   std::pair{"blank.json", "  \n"}}) {
    SCOPED_TRACE(name);
    const std::string path = WriteTempFile(name, text);
    const ProcessResult r =
        Ctl({"plan", "--spec", path, "--world-size", "8", "--coordinator", address_});
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_THAT(r.err, HasSubstr(path));
  }
}

// The coordinator answers RESOURCE_EXHAUSTED (the answer would be too
// large): refused, exit code 5, not "unreachable".
TEST_F(MuonmeshCtlTest, RefusedPlanExits5) {
  REQUIRE_GPT2();
  const ProcessResult r = Gpt2("plan", "262144", {"--strategy", "no_shard"});
  EXPECT_EQ(r.exit_code, 5) << r.err;
  EXPECT_THAT(r.err, HasSubstr("server limit 256 MiB"));
  EXPECT_THAT(r.err, HasSubstr(address_));
}

// A 10 MB unit name: invalid config, reported in a few hundred bytes.
TEST_F(MuonmeshCtlTest, HugeNamesAreRefusedWithoutEchoingThem) {
  const std::string path = WriteTempFile(
      "huge_name.json", absl::StrCat("{\"name\": \"m\", \"units\": [{\"name\": \"",
                                     std::string(10 << 20, 'u'),
                                     "\", \"params\": [{\"name\": \"w\", \"shape\": [4, 4], "
                                     "\"optimizer\": \"muon\"}]}]}\n"));
  for (const char* command : {"validate", "plan"}) {
    SCOPED_TRACE(command);
    const ProcessResult r =
        Ctl({command, "--spec", path, "--world-size", "8", "--coordinator", address_});
    EXPECT_EQ(r.exit_code, 1) << r.err.substr(0, 2000);
    EXPECT_THAT(r.err, HasSubstr("model.units[0].name: unit name of 10485760 bytes exceeds the "
                                 "limit of 1024 bytes"));
    EXPECT_LT(r.err.size() + r.out.size(), 2048u);
  }
}

// 1000 layers of one [2^20, 2^20] matrix on 16384 ranks (16M holder
// entries): refused from the spec's counts before planning, costing the
// coordinator little memory and CPU; 900 pass the planner's own limit but
// not the answer's.
TEST_F(MuonmeshCtlTest, PlansTooBigAreRefusedBeforePlanning) {
  const std::string spec1000 =
      WriteTempFile("huge1000.json", LayersSpec(1000, 1, int64_t{1} << 20, int64_t{1} << 20));
  const std::string spec900 =
      WriteTempFile("huge900.json", LayersSpec(900, 1, int64_t{1} << 20, int64_t{1} << 20));
  const double cpu_before = CpuSeconds(coordinator_);
  ASSERT_GE(cpu_before, 0);
  ProcessResult r = Ctl({"plan", "--spec", spec1000, "--world-size", "16384", "--coordinator",
                         address_});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("world_size: planning would take about"));
  r = Ctl({"plan", "--spec", spec900, "--world-size", "16384", "--coordinator", address_});
  EXPECT_EQ(r.exit_code, 5) << r.err;
  EXPECT_THAT(r.err, HasSubstr("server limit 256 MiB"));
  // Planning either would take over a GB and seconds of CPU.
  EXPECT_LT(CpuSeconds(coordinator_) - cpu_before, 1.0);
  const int64_t peak = PeakRssBytes(coordinator_);
  ASSERT_GT(peak, 0);
  EXPECT_LT(peak, int64_t{300} << 20);
}

// 40,000 layers of ten [64, 64] Muon matrices (a 23 MB spec) on 128 ranks:
// seconds of planning. A client that gives up after 1 s leaves the server
// idle: it uses under 0.5 s of CPU in the 2 s after the client's deadline.
TEST_F(MuonmeshCtlTest, PlanWhoseClientGivesUpLeavesTheServerIdle) {
  const std::string spec = WriteTempFile("layers40k.json", LayersSpec(40'000, 10, 64, 64));
  const double cpu_before = CpuSeconds(coordinator_);
  const ProcessResult r = Ctl({"plan", "--spec", spec, "--world-size", "128", "--timeout", "1",
                               "--coordinator", address_});
  const double cpu_at_deadline = CpuSeconds(coordinator_);
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_THAT(r.err, HasSubstr("Deadline"));
  // The server did receive and work on the call.
  EXPECT_GT(cpu_at_deadline - cpu_before, 0.02);
  std::this_thread::sleep_for(std::chrono::seconds(2));
  EXPECT_LT(CpuSeconds(coordinator_) - cpu_at_deadline, 0.5);
  // And it serves the next call.
  ASSERT_TRUE(muonmesh::testing::ModelSpecExists(Gpt2Spec()));
  EXPECT_EQ(Gpt2("plan", "8").exit_code, 0);
}

// SIGINT while the coordinator plans: it cancels the plan and exits 0
// within its grace period; the client is told the coordinator is going
// away (unreachable, exit code 3).
TEST_F(MuonmeshCtlTest, SigintDuringAPlanExitsWithinTheGrace) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinator({"--shutdown-grace", "10s"}));
  const std::string spec = WriteTempFile("layers40k.json", LayersSpec(40'000, 10, 64, 64));
  const double cpu_before = CpuSeconds(coordinator_);
  ProcessResult client;
  std::thread call([&] {
    client = Ctl({"plan", "--spec", spec, "--world-size", "128", "--timeout", "120",
                  "--coordinator", address_});
  });
  // Planning has begun once the server has used a second of CPU: receiving
  // and checking the request takes well under that.
  const bool busy = WaitForCpu(coordinator_, cpu_before, 1.0);
  kill(coordinator_, SIGINT);
  bool timed_out = false;
  const int code = testing::WaitOrKill(
      coordinator_, std::chrono::steady_clock::now() + std::chrono::seconds(10), &timed_out);
  coordinator_ = -1;
  call.join();
  ASSERT_TRUE(busy) << "the coordinator never started planning";
  EXPECT_FALSE(timed_out) << "the coordinator outlived its 10 s grace";
  EXPECT_EQ(code, 0);
  EXPECT_EQ(client.exit_code, 3) << client.err;
  EXPECT_THAT(client.err, HasSubstr("shutting down"));
}

TEST_F(MuonmeshCtlTest, CoordinatorStopsCleanlyOnSigint) { StopCoordinator(SIGINT); }


// `validate --job`: a job checked here, with no coordinator running, every
// violation on its own line; a valid one printed with its defaults filled
// in; a token outside the vocabulary named with its file and index.
// One directory per test: ctest runs each test as its own process, two at
// a time, and a shared one was emptied under its neighbour.
std::string ValidateDir() {
  const std::string dir = ::testing::TempDir() + "/muonmeshctl_validate_job_" +
                          ::testing::UnitTest::GetInstance()->current_test_info()->name();
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::string WriteText(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

// `plan --job` of a gpt job on 2 ZeRO-3 ranks: with the job's
// communication.reshard_after_forward true, its units are gathered again for
// the backward pass (param_allgather_backward). Held — the job's false,
// --no-reshard-after-forward over that job, or the job leaving it unset (its
// model fits one bucket) — that collective is gone, every other one moves the
// same bytes, and the table says each unit is gathered once;
// --reshard-after-forward over the unset job gathers again.
TEST_F(MuonmeshCtlTest, PlanOfAJobHoldingItsUnitsHasNoRegathers) {
  const std::string dir = ValidateDir();
  WriteText(dir + "/corpus.txt", std::string(300, 'x'));
  const std::string job = R"(name: lm
world_size: 2
model: {gpt: {vocab_size: 256, block_size: 8, n_layer: 2, n_head: 1, n_embd: 8, seq_len: 8}}
data: {text: {train: corpus.txt}}
training: {steps: 1, global_batch_size: 2}
)";
  const std::string unset = WriteText(dir + "/unset.yaml", job);
  const std::string regathering =
      WriteText(dir + "/regathering.yaml", job + "communication: {reshard_after_forward: true}\n");
  const std::string held =
      WriteText(dir + "/held.yaml", job + "communication: {reshard_after_forward: false}\n");
  auto bytes = [&](std::vector<std::string> args) {
    args.insert(args.begin(), {"plan", "--coordinator", address_, "--json"});
    const ProcessResult r = Ctl(args);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    v1::Plan plan;
    google::protobuf::util::JsonParseOptions options;
    options.ignore_unknown_fields = true;
    EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(r.out, &plan, options).ok());
    std::map<std::string, int64_t> by_name;
    for (const v1::CollectiveBytes& c : plan.collectives()) by_name[c.name()] += c.bytes_per_step();
    return by_name;
  };
  std::map<std::string, int64_t> again = bytes({"--job", regathering});
  EXPECT_EQ(bytes({"--job", unset, "--reshard-after-forward"}), again);
  ASSERT_GT(again["param_allgather_backward"], 0);
  again.erase("param_allgather_backward");
  EXPECT_EQ(bytes({"--job", held}), again);
  EXPECT_EQ(bytes({"--job", regathering, "--no-reshard-after-forward"}), again);
  EXPECT_EQ(bytes({"--job", unset}), again);
  for (const std::string& path : {held, unset}) {
    const ProcessResult table = Ctl({"plan", "--coordinator", address_, "--job", path});
    ASSERT_EQ(table.exit_code, 0) << table.err;
    EXPECT_THAT(table.out, HasSubstr("each unit gathered once, held for the backward pass"));
  }
  const ProcessResult both = Ctl({"plan", "--coordinator", address_, "--job", unset,
                                  "--reshard-after-forward", "--no-reshard-after-forward"});
  EXPECT_NE(both.exit_code, 0);
  EXPECT_THAT(both.err, HasSubstr("give one of them"));
}

TEST(MuonmeshCtlValidateJobTest, EveryViolationOnItsOwnLineWithoutACoordinator) {
  const std::string dir = ValidateDir();
  const std::string job = WriteText(dir + "/bad.yaml", R"(name: bad
world_size: 2
model: {gpt: {vocab_size: 256, block_size: 8, n_layer: 1, n_head: 1, n_embd: 8, seq_len: 8}}
data: {tokens: {train: "missing_*.bin"}}
training: {steps: 1, global_batch_size: 3}
)");
  const ProcessResult r =
      testing::Run({MUONMESHCTL_BIN, "validate", "--job", job}, kCallBound);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_EQ(r.out, "");
  const std::vector<std::string> lines = absl::StrSplit(r.err, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2u) << r.err;
  EXPECT_THAT(lines[0], ::testing::StartsWith("training.global_batch_size: 3 does not split"));
  EXPECT_THAT(lines[1], ::testing::StartsWith("data.tokens.train: no file matches"));
}

TEST(MuonmeshCtlValidateJobTest, AValidJobIsPrintedWithItsDefaultsAndItsData) {
  const std::string dir = ValidateDir();
  WriteText(dir + "/corpus.txt", std::string(300, 'x'));
  const std::string job = WriteText(dir + "/lm.yaml", R"(name: lm
world_size: 2
model: {gpt: {vocab_size: 256, block_size: 8, n_layer: 1, n_head: 1, n_embd: 8, seq_len: 8}}
data: {text: {train: corpus.txt}}
training: {steps: 1, global_batch_size: 2}
)");
  const ProcessResult r =
      testing::Run({MUONMESHCTL_BIN, "validate", "--job", job}, kCallBound);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, ::testing::StartsWith("valid: lm, gpt on 2 cpu ranks\n"
                                           "data: 300 training tokens in 1 files"));
  const ProcessResult j =
      testing::Run({MUONMESHCTL_BIN, "validate", "--job", job, "--json"}, kCallBound);
  ASSERT_EQ(j.exit_code, 0) << j.err;
  v1::JobSpec filled;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(j.out, &filled).ok()) << j.out;
  EXPECT_EQ(filled.optimizer().muon().lr(), 0.02);  // job.h's table of defaults
  EXPECT_EQ(filled.optimizer().adamw().beta2(), 0.999);
  EXPECT_EQ(filled.training().keep_checkpoints(), 2);
  EXPECT_EQ(filled.parallelism().data_parallel_sharding_strategy(), "optim_grads_params");
  EXPECT_EQ(filled.parallelism().num_distributed_optimizer_instances(), 1);
  EXPECT_EQ(filled.output().dir(),
            (std::filesystem::path(dir) / "runs/lm").lexically_normal().string());
}

TEST(MuonmeshCtlValidateJobTest, ATokenOutsideTheVocabularyIsNamedUnlessNotScanned) {
  const std::string dir = ValidateDir();
  // An llm.c shard of 3 tokens, the last 300 (magic, version, count, 253 zero ints).
  std::string shard;
  for (int32_t v : {20240520, 1, 3}) shard.append(reinterpret_cast<const char*>(&v), 4);
  shard.append(253 * 4, '\0');
  for (uint16_t t : {1, 2, 300}) shard.append(reinterpret_cast<const char*>(&t), 2);
  const std::string bin = WriteText(dir + "/s.bin", shard);
  const std::string job = WriteText(dir + "/lm.yaml", R"(name: lm
world_size: 1
model: {gpt: {vocab_size: 300, block_size: 2, n_layer: 1, n_head: 1, n_embd: 8, seq_len: 2}}
data: {tokens: {train: s.bin, val_fraction: 0}}
training: {steps: 1, global_batch_size: 1}
)");
  const ProcessResult r =
      testing::Run({MUONMESHCTL_BIN, "validate", "--job", job}, kCallBound);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err, "data.tokens.train: " +
                       (std::filesystem::path(dir) / "s.bin").lexically_normal().string() +
                       ": token 2 is 300, outside the model's vocabulary [0, 300)\n");
  const ProcessResult headers =
      testing::Run({MUONMESHCTL_BIN, "validate", "--job", job, "--no-scan"}, kCallBound);
  EXPECT_EQ(headers.exit_code, 0) << headers.err;
  EXPECT_THAT(headers.out, ::testing::HasSubstr("(headers only: --no-scan)"));
}

}  // namespace
}  // namespace muonmesh
