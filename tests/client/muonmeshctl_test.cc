// muonmeshctl end to end: the real muonmesh-coordinator as a child process
// on 127.0.0.1:0 and the real muonmeshctl binary, checked by exit code and
// output. Every wait is bounded.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/subprocess.h"

namespace muonmesh {
namespace {

using ::muonmesh::testing::ProcessResult;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr std::chrono::seconds kCallBound(60);

std::string Gpt2Spec() { return std::string(MUONMESH_SHARED_DIR) + "/specs/gpt2-124m.json"; }

bool HaveGpt2() { return std::ifstream(Gpt2Spec()).good(); }

std::string WriteTempFile(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "/muonmeshctl_test_" + name;
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

class MuonmeshCtlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int out_pipe[2];
    ASSERT_EQ(pipe2(out_pipe, O_CLOEXEC), 0);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out_pipe[1], STDOUT_FILENO);
    std::vector<std::string> argv = {MUONMESH_COORDINATOR_BIN, "--listen", "127.0.0.1:0"};
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

#define REQUIRE_GPT2() \
  if (!HaveGpt2()) GTEST_SKIP() << Gpt2Spec() << " not found"

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
        "\"dim_names\": [",   "\"placements\": ["}) {
    EXPECT_TRUE(absl::StrContains(r.out, key)) << key;  // not HasSubstr: 100 KiB of output
  }
  // A timing would break byte-identical output.
  EXPECT_FALSE(absl::StrContains(r.out, "plan_seconds"));
  // int64 fields are numbers, never strings.
  EXPECT_TRUE(absl::StrContains(r.out, "\"parameters\": 124439808,"));
}

TEST_F(MuonmeshCtlTest, PlanTableShowsMeshPlacementsAndPadding) {
  REQUIRE_GPT2();
  const ProcessResult r = Gpt2("plan", "8", {"--instances", "2", "--outer-strategy", "optim"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* text :
       {"gpt2-124m", "dense mesh", "(dp_outer=2, dp_shard=4)", "HFSDP", "Partial(avg)", "padding",
        "Muon makespan", "Muon exchange", "param_allgather", "most loaded"}) {
    EXPECT_THAT(r.out, HasSubstr(text));
  }
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
TEST_F(MuonmeshCtlTest, SilentCoordinatorExits3AtTheDeadline) {
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
  EXPECT_EQ(r.exit_code, 3) << r.err;
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
  const ProcessResult plan_help = Ctl({"plan", "--help"});
  EXPECT_EQ(plan_help.exit_code, 0);
  for (const char* flag : {"--spec FILE", "--world-size W", "--owner-rule R", "--ns-steps T",
                           "--include-shards", "--timeout SECONDS", "--json"}) {
    EXPECT_THAT(plan_help.out, HasSubstr(flag));
  }
  const ProcessResult validate_help = Ctl({"validate", "-h"});
  EXPECT_EQ(validate_help.exit_code, 0);
  EXPECT_THAT(validate_help.out, HasSubstr("--instances I"));
}

TEST_F(MuonmeshCtlTest, CoordinatorHelpAndBadFlags) {
  const ProcessResult help = testing::Run({MUONMESH_COORDINATOR_BIN, "--help"}, kCallBound);
  EXPECT_EQ(help.exit_code, 0) << help.err;
  EXPECT_THAT(help.out, HasSubstr("--listen"));
  EXPECT_THAT(help.out, HasSubstr("--shutdown_grace"));
  // The port our fixture's coordinator holds cannot be taken twice.
  const ProcessResult taken =
      testing::Run({MUONMESH_COORDINATOR_BIN, "--listen", address_}, kCallBound);
  EXPECT_EQ(taken.exit_code, 1);
  EXPECT_THAT(taken.err, HasSubstr("cannot listen on " + address_));
}

TEST_F(MuonmeshCtlTest, CoordinatorStopsCleanlyOnSigint) { StopCoordinator(SIGINT); }

}  // namespace
}  // namespace muonmesh
