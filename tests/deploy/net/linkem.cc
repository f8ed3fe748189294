// linkem: a user-space Ethernet switch joining network namespaces, with the
// faults a real network has and that this kernel's traffic control lacks (no
// sch_netem, no tc classifiers, no iptables): a one-way delay, a rate per
// host link, random loss, and cuts between two hosts or around one.
//
//   linkem --prefix PFX --hosts c,0,1,2,3 [--control FIFO] [--seed S]
//          [--buffer-ms MS]
//
// It makes one TAP interface per host, named PFX<host>, prints "ready" and
// forwards frames among them as a learning switch does. The caller moves each
// interface into its host's namespace and gives it an address
// (tests/deploy/net/hosts.sh does). Commands, one per line, on the control
// FIFO (stdin without --control):
//   delay MS     every frame arrives MS milliseconds later (one way)
//   rate MBIT    each host's link carries MBIT megabits/s each way (0: no limit)
//   loss P       every frame is dropped with probability P
//   cut A B      every frame between hosts A and B is dropped; join A B ends it
//   down A       every frame to or from host A is dropped; up A ends it
//   reset        no delay, rate limit, loss, cut or host down
//   stats        prints each host's frame counts
//   quit         stops (so do SIGINT and SIGTERM)
// Each is answered on stdout with "ok: LINE" or "error: LINE: why".
//
// A frame waits for its sender's link, the delay, then its receiver's link;
// one that would wait longer than --buffer-ms (default 50) for a link is
// dropped, as a router's full queue drops it. Frames to one host keep their
// order. docs/architecture.md §7 ("Network faults on one machine") says
// what the benches built on it measure.

#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace {

volatile sig_atomic_t g_stop = 0;
void OnSignal(int) { g_stop = 1; }

int64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

struct Frame {
  int64_t due_ns;
  std::vector<uint8_t> bytes;
};

struct Counts {
  uint64_t in = 0;        // frames the host sent
  uint64_t out = 0;       // frames delivered to the host
  uint64_t lost = 0;      // dropped by `loss`, counted at the sender
  uint64_t cut = 0;       // dropped by a cut or a down host, at the sender
  uint64_t overflow = 0;  // dropped by a full queue (either link) or a full TAP
};

struct Port {
  std::string host;
  int fd = -1;
  bool down = false;
  std::deque<Frame> queue;   // toward the host, in due order
  int64_t up_free_ns = 0;    // its link toward the switch is busy until then
  int64_t down_free_ns = 0;  // its link from the switch is busy until then
  int64_t last_due_ns = 0;
  Counts counts;
};

// A TAP interface named NAME; its descriptor, or -1 with the reason on stderr.
int OpenTap(const std::string& name) {
  int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    std::fprintf(stderr, "linkem: /dev/net/tun: %s\n", std::strerror(errno));
    return -1;
  }
  ifreq ifr{};
  ifr.ifr_flags = IFF_TAP | IFF_NO_PI;
  std::snprintf(ifr.ifr_name, IFNAMSIZ, "%s", name.c_str());
  if (ioctl(fd, TUNSETIFF, &ifr) < 0) {
    std::fprintf(stderr, "linkem: TAP %s: %s\n", name.c_str(), std::strerror(errno));
    close(fd);
    return -1;
  }
  return fd;
}

class Switch {
 public:
  Switch(std::vector<Port> ports, uint64_t seed, int64_t buffer_ns)
      : ports_(std::move(ports)), rng_(seed), buffer_ns_(buffer_ns) {}

  std::vector<Port>& ports() { return ports_; }

  // Takes the frame host SRC sent at NOW: learns its address, then queues a
  // copy for each host it goes to.
  void Forward(size_t src, std::vector<uint8_t> bytes, int64_t now) {
    Port& from = ports_[src];
    ++from.counts.in;
    if (bytes.size() < 14) return;  // not Ethernet
    macs_[Mac(bytes.data() + 6)] = src;
    if (from.down) {
      ++from.counts.cut;
      return;
    }
    if (loss_ > 0 && std::bernoulli_distribution(loss_)(rng_)) {
      ++from.counts.lost;
      return;
    }
    int64_t wire = WireNs(bytes.size());
    int64_t sent = std::max(now, from.up_free_ns) + wire;
    if (sent - wire - now > buffer_ns_) {
      ++from.counts.overflow;
      return;
    }
    from.up_free_ns = sent;
    std::vector<size_t> to;
    auto known = macs_.find(Mac(bytes.data()));
    if (known != macs_.end() && !(bytes[0] & 1)) {
      to.push_back(known->second);
    } else {  // broadcast, multicast or not yet learned: flood
      for (size_t i = 0; i < ports_.size(); ++i) {
        if (i != src) to.push_back(i);
      }
    }
    for (size_t i = 0; i < to.size(); ++i) {
      size_t dst = to[i];
      if (dst == src) continue;
      if (ports_[dst].down || cuts_.count(Pair(src, dst))) {
        ++from.counts.cut;
        continue;
      }
      Queue(dst, i + 1 == to.size() ? std::move(bytes) : bytes, sent + delay_ns_, wire);
    }
  }

  // Writes every frame due by NOW; the time of the next one due, if any.
  std::optional<int64_t> Deliver(int64_t now) {
    std::optional<int64_t> next;
    for (Port& port : ports_) {
      while (!port.queue.empty() && port.queue.front().due_ns <= now) {
        const std::vector<uint8_t>& bytes = port.queue.front().bytes;
        if (write(port.fd, bytes.data(), bytes.size()) < 0) {
          ++port.counts.overflow;  // the TAP's own queue is full (or it is down)
        } else {
          ++port.counts.out;
        }
        port.queue.pop_front();
      }
      if (!port.queue.empty()) {
        int64_t due = port.queue.front().due_ns;
        next = next ? std::min(*next, due) : due;
      }
    }
    return next;
  }

  // Runs one control command; the answer line.
  std::string Command(const std::string& line) {
    std::vector<std::string> words = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    if (words.empty()) return "";
    std::string error = Run(words);
    return error.empty() ? absl::StrCat("ok: ", line) : absl::StrCat("error: ", line, ": ", error);
  }

  std::string Stats() const {
    std::string out;
    for (const Port& p : ports_) {
      absl::StrAppend(&out, "host ", p.host, ": sent ", p.counts.in, " received ", p.counts.out,
                      " lost ", p.counts.lost, " cut ", p.counts.cut, " overflow ",
                      p.counts.overflow, "\n");
    }
    return out;
  }

 private:
  static uint64_t Mac(const uint8_t* p) {
    uint64_t mac = 0;
    for (int i = 0; i < 6; ++i) mac = mac << 8 | p[i];
    return mac;
  }
  static std::pair<size_t, size_t> Pair(size_t a, size_t b) { return {std::min(a, b), std::max(a, b)}; }

  int64_t WireNs(size_t bytes) const {
    return rate_bps_ == 0 ? 0 : static_cast<int64_t>(bytes * 8 * 1e9 / rate_bps_);
  }

  // A copy for DST that arrives at the switch's far side at ARRIVES.
  void Queue(size_t dst, std::vector<uint8_t> bytes, int64_t arrives, int64_t wire) {
    Port& to = ports_[dst];
    int64_t due = std::max(arrives, to.down_free_ns) + wire;
    if (due - wire - arrives > buffer_ns_) {
      ++to.counts.overflow;
      return;
    }
    to.down_free_ns = due;
    due = std::max(due, to.last_due_ns);  // a shorter delay set now must not reorder
    to.last_due_ns = due;
    to.queue.push_back(Frame{due, std::move(bytes)});
  }

  std::optional<size_t> Host(const std::string& name) const {
    for (size_t i = 0; i < ports_.size(); ++i) {
      if (ports_[i].host == name) return i;
    }
    return std::nullopt;
  }

  std::string Run(const std::vector<std::string>& w) {
    const std::string& verb = w[0];
    if (verb == "stats" && w.size() == 1) {
      std::fputs(Stats().c_str(), stdout);
      return "";
    }
    if (verb == "reset" && w.size() == 1) {
      delay_ns_ = 0;
      rate_bps_ = 0;
      loss_ = 0;
      cuts_.clear();
      for (Port& p : ports_) p.down = false;
      return "";
    }
    if (verb == "quit" && w.size() == 1) {
      g_stop = 1;
      return "";
    }
    if ((verb == "delay" || verb == "rate" || verb == "loss") && w.size() == 2) {
      double v;
      if (!absl::SimpleAtod(w[1], &v) || v < 0 || (verb == "loss" && v > 1)) {
        return verb == "loss" ? "wants a probability in [0, 1]" : "wants a number >= 0";
      }
      if (verb == "delay") delay_ns_ = static_cast<int64_t>(v * 1e6);
      if (verb == "rate") rate_bps_ = v * 1e6;
      if (verb == "loss") loss_ = v;
      return "";
    }
    if ((verb == "down" || verb == "up") && w.size() == 2) {
      std::optional<size_t> a = Host(w[1]);
      if (!a) return absl::StrCat("no host ", w[1]);
      ports_[*a].down = verb == "down";
      return "";
    }
    if ((verb == "cut" || verb == "join") && w.size() == 3) {
      std::optional<size_t> a = Host(w[1]), b = Host(w[2]);
      if (!a || !b || *a == *b) return "wants two different hosts";
      if (verb == "cut") cuts_.insert(Pair(*a, *b));
      if (verb == "join") cuts_.erase(Pair(*a, *b));
      return "";
    }
    return "unknown command (delay MS, rate MBIT, loss P, cut A B, join A B, down A, up A, "
           "reset, stats, quit)";
  }

  std::vector<Port> ports_;
  std::map<uint64_t, size_t> macs_;
  std::set<std::pair<size_t, size_t>> cuts_;
  std::mt19937_64 rng_;
  int64_t buffer_ns_;
  int64_t delay_ns_ = 0;
  double rate_bps_ = 0;
  double loss_ = 0;
};

struct Options {
  std::string prefix;
  std::vector<std::string> hosts;
  std::string control;
  uint64_t seed = 1;
  double buffer_ms = 50;
};

std::optional<Options> ParseArgs(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "linkem: %s wants a value\n", flag.c_str());
      return std::nullopt;
    }
    std::string value = argv[++i];
    bool ok = true;
    if (flag == "--prefix") {
      o.prefix = value;
    } else if (flag == "--hosts") {
      o.hosts = absl::StrSplit(value, ',', absl::SkipEmpty());
    } else if (flag == "--control") {
      o.control = value;
    } else if (flag == "--seed") {
      ok = absl::SimpleAtoi(value, &o.seed);
    } else if (flag == "--buffer-ms") {
      ok = absl::SimpleAtod(value, &o.buffer_ms) && o.buffer_ms > 0;
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "linkem: bad flag %s %s\n", flag.c_str(), value.c_str());
      return std::nullopt;
    }
  }
  if (o.prefix.empty() || o.hosts.empty()) {
    std::fprintf(stderr,
                 "usage: linkem --prefix PFX --hosts A,B,... [--control FIFO] [--seed S] "
                 "[--buffer-ms MS]\n");
    return std::nullopt;
  }
  return o;
}

// Reads what the control descriptor has; runs each complete line.
void ReadCommands(int fd, std::string& pending, Switch& sw) {
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof buf)) > 0) {
    pending.append(buf, static_cast<size_t>(n));
    size_t end;
    while ((end = pending.find('\n')) != std::string::npos) {
      std::string answer = sw.Command(pending.substr(0, end));
      pending.erase(0, end + 1);
      if (!answer.empty()) std::printf("%s\n", answer.c_str());
    }
    std::fflush(stdout);
  }
}

int Serve(Switch& sw, int control) {
  std::vector<pollfd> fds;
  for (Port& p : sw.ports()) fds.push_back(pollfd{p.fd, POLLIN, 0});
  fds.push_back(pollfd{control, POLLIN, 0});
  std::string pending;
  std::vector<uint8_t> buf(65536);
  while (!g_stop) {
    std::optional<int64_t> next = sw.Deliver(NowNs());
    timespec wait{};
    if (next) {
      int64_t ns = std::max<int64_t>(0, *next - NowNs());
      wait = timespec{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
    }
    int ready = ppoll(fds.data(), fds.size(), next ? &wait : nullptr, nullptr);
    if (ready < 0 && errno != EINTR) {
      std::fprintf(stderr, "linkem: poll: %s\n", std::strerror(errno));
      return 1;
    }
    if (ready <= 0) continue;
    for (size_t i = 0; i + 1 < fds.size(); ++i) {
      if (!(fds[i].revents & POLLIN)) continue;
      for (int k = 0; k < 64; ++k) {  // a few at a time: no host starves the rest
        ssize_t n = read(fds[i].fd, buf.data(), buf.size());
        if (n <= 0) break;
        sw.Forward(i, std::vector<uint8_t>(buf.begin(), buf.begin() + n), NowNs());
      }
    }
    if (fds.back().revents & POLLIN) ReadCommands(control, pending, sw);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::optional<Options> options = ParseArgs(argc, argv);
  if (!options) return 2;
  std::vector<Port> ports;
  for (const std::string& host : options->hosts) {
    Port p;
    p.host = host;
    p.fd = OpenTap(options->prefix + host);
    if (p.fd < 0) return 1;
    ports.push_back(std::move(p));
  }
  int control = 0;
  if (!options->control.empty()) {
    // Opened for writing too, so that the FIFO never reads as closed between writers.
    control = open(options->control.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (control < 0) {
      std::fprintf(stderr, "linkem: %s: %s\n", options->control.c_str(), std::strerror(errno));
      return 1;
    }
  } else {
    fcntl(0, F_SETFL, fcntl(0, F_GETFL) | O_NONBLOCK);
  }
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  Switch sw(std::move(ports), options->seed, static_cast<int64_t>(options->buffer_ms * 1e6));
  std::printf("ready\n");
  std::fflush(stdout);
  int rc = Serve(sw, control);
  std::fputs(sw.Stats().c_str(), stdout);
  return rc;
}
