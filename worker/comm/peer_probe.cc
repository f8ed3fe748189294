#include "worker/comm/peer_probe.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/numbers.h"
#include "core/base/status_macros.h"

namespace muonmesh::comm {
namespace {

// A file descriptor closed on destruction.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      if (fd_ >= 0) ::close(fd_);
      fd_ = other.release();
    }
    return *this;
  }
  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

std::string Errno(int e) { return std::strerror(e); }

// "host:port", brackets around an IPv6 host.
std::string JoinHostPort(const std::string& host, int port) {
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port)
                                             : absl::StrCat(host, ":", port);
}

bool SplitHostPort(const std::string& address, std::string* host, std::string* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) return false;
  *host = address.substr(0, colon);
  *port = address.substr(colon + 1);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  return !port->empty();
}

// A listening socket on `host`, any port; the port in *port.
absl::StatusOr<int> Listen(const std::string& host, int* port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int rc = ::getaddrinfo(host.c_str(), "0", &hints, &found); rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer probe: cannot resolve ", host, ": ", ::gai_strerror(rc)));
  }
  std::string last = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 128) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) == 0) {
      *port = ntohs(bound.ss_family == AF_INET6
                        ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                        : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
      ::freeaddrinfo(found);
      return fd;
    }
    last = Errno(errno);
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return absl::InvalidArgumentError(absl::StrCat("peer probe: cannot listen on ", host, ": ", last));
}

// Connects to `address` within `timeout`; "" on success, else why not.
// With `connected`, the open connection goes there (non-blocking).
std::string TryConnect(const std::string& address, absl::Duration timeout, int* connected = nullptr) {
  std::string host, port;
  if (!SplitHostPort(address, &host, &port)) return "not a host:port address";
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return ::gai_strerror(rc);
  }
  std::string why = "no address";
  const absl::Time deadline = absl::Now() + timeout;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol));
    if (fd.get() < 0) {
      why = Errno(errno);
      continue;
    }
    if (::connect(fd.get(), a->ai_addr, a->ai_addrlen) == 0) {
      why.clear();
      if (connected != nullptr) *connected = fd.release();
      break;
    }
    if (errno != EINPROGRESS) {
      why = Errno(errno);
      continue;
    }
    pollfd p{fd.get(), POLLOUT, 0};
    const int64_t ms = std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now()));
    const int ready = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 1 << 30)));
    if (ready == 0) {
      why = absl::StrCat("no answer within ", absl::FormatDuration(timeout));
      continue;
    }
    int error = 0;
    socklen_t len = sizeof error;
    if (ready < 0 || ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &len) != 0) {
      error = errno;
    }
    if (error == 0) {
      why.clear();
      if (connected != nullptr) *connected = fd.release();
      break;
    }
    why = Errno(error);
  }
  ::freeaddrinfo(found);
  return why;
}

// Waits until `fd` is ready for `events` or `deadline`; false on timeout.
bool WaitFor(int fd, short events, absl::Time deadline) {
  pollfd p{fd, events, 0};
  const int64_t ms = std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now()));
  return ::poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 1 << 30))) > 0;
}

}  // namespace

EchoListener::~EchoListener() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
  if (fd_ >= 0) ::close(fd_);
}

absl::StatusOr<std::unique_ptr<EchoListener>> EchoListener::Start(const std::string& host) {
  auto out = std::unique_ptr<EchoListener>(new EchoListener());
  MUONMESH_ASSIGN_OR_RETURN(out->fd_, Listen(host, &out->port_));
  EchoListener* self = out.get();
  self->thread_ = std::thread([self] { self->Serve(); });
  return out;
}

void EchoListener::Serve() {
  // The open connections, each dropped a second after it was accepted if
  // it has sent nothing; all polled together with the listener.
  struct Open {
    Fd fd;
    absl::Time drop_at;
  };
  std::vector<Open> open;
  std::vector<pollfd> polled;
  while (!stop_.load()) {
    polled.assign(1, pollfd{fd_, POLLIN, 0});
    for (const Open& o : open) polled.push_back(pollfd{o.fd.get(), POLLIN, 0});
    if (::poll(polled.data(), polled.size(), 50) < 0) continue;
    const absl::Time now = absl::Now();
    std::vector<Open> kept;
    for (size_t i = 0; i < open.size(); ++i) {
      if ((polled[i + 1].revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
        char byte = 0;  // one byte back for the byte sent
        if (::recv(open[i].fd.get(), &byte, 1, MSG_DONTWAIT) == 1) {
          (void)::send(open[i].fd.get(), &byte, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
        }
        continue;  // closed
      }
      if (now < open[i].drop_at) kept.push_back(std::move(open[i]));
    }
    open = std::move(kept);
    if ((polled[0].revents & POLLIN) != 0 && open.size() < kMaxOpen) {
      Fd peer(::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (peer.get() >= 0) open.push_back({std::move(peer), now + absl::Seconds(1)});
    }
  }
}

absl::Status EchoCheck(const std::string& host, int port, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  const std::string address = JoinHostPort(host, port);
  int connected = -1;
  if (const std::string why = TryConnect(address, timeout, &connected); !why.empty()) {
    if (why == Errno(ECONNREFUSED)) {
      // The host answered: nothing listens there (the process is gone).
      return absl::NotFoundError(absl::StrCat("connect to ", address, ": ", why));
    }
    return absl::UnavailableError(absl::StrCat("connect to ", address, ": ", why));
  }
  Fd fd(connected);
  const char sent = 'm';
  char back = 0;
  if (!WaitFor(fd.get(), POLLOUT, deadline) ||
      ::send(fd.get(), &sent, 1, MSG_NOSIGNAL | MSG_DONTWAIT) != 1) {
    return absl::UnavailableError(absl::StrCat(address, ": cannot send: ", Errno(errno)));
  }
  if (!WaitFor(fd.get(), POLLIN, deadline)) {
    return absl::DeadlineExceededError(absl::StrCat(
        address, ": connected, but no answer within ", absl::FormatDuration(timeout)));
  }
  if (::recv(fd.get(), &back, 1, MSG_DONTWAIT) != 1 || back != sent) {
    return absl::UnavailableError(absl::StrCat(address, ": closed without answering"));
  }
  return absl::OkStatus();
}

absl::Status ProbePeers(Store& store, const std::string& prefix, int rank, int size,
                        const std::string& host, absl::Duration connect_timeout,
                        absl::Duration rendezvous_timeout) {
  if (size <= 1) return absl::OkStatus();
  int port = 0;
  MUONMESH_ASSIGN_OR_RETURN(const int listen_fd, Listen(host, &port));
  Fd listener(listen_fd);
  // Accepts (and drops) the peers' connections until every rank is done.
  std::atomic<bool> stop{false};
  std::thread acceptor([&] {
    while (!stop.load()) {
      pollfd p{listener.get(), POLLIN, 0};
      if (::poll(&p, 1, 50) > 0) {
        const int fd = ::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC);
        if (fd >= 0) ::close(fd);
      }
    }
  });
  const auto finish = [&](absl::Status status) {
    stop.store(true);
    acceptor.join();
    return status;
  };
  const std::string me = JoinHostPort(host, port);
  if (absl::Status s = store.Set(absl::StrCat(prefix, "probe/", rank), me); !s.ok()) {
    return finish(s);
  }
  for (int q = 0; q < size; ++q) {
    if (q == rank) continue;
    absl::StatusOr<std::string> peer =
        store.Get(absl::StrCat(prefix, "probe/", q), rendezvous_timeout);
    if (!peer.ok()) return finish(peer.status());
    if (const std::string why = TryConnect(*peer, connect_timeout); !why.empty()) {
      return finish(absl::UnavailableError(absl::StrCat("rank ", rank, " (", host,
                                                        ") cannot reach rank ", q, " at ", *peer,
                                                        ": ", why)));
    }
  }
  // Keep listening until the others have reached this rank too.
  if (absl::Status s = store.Set(absl::StrCat(prefix, "probed/", rank), "1"); !s.ok()) {
    return finish(s);
  }
  std::vector<std::string> done;
  for (int q = 0; q < size; ++q) done.push_back(absl::StrCat(prefix, "probed/", q));
  return finish(store.Wait(done, rendezvous_timeout));
}

}  // namespace muonmesh::comm
