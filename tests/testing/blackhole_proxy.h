#pragma once

// A TCP proxy on loopback that can turn into a black hole: a network
// partition for tests, without network namespaces. While open it forwards
// bytes both ways between each accepted connection and the target; while
// blocked it forwards nothing on any connection, old or new (accepted ones
// stay open and their bytes wait in the kernel's buffers), which is what a
// dropped link looks like to both ends: no reset, no FIN, just silence.
// Opening it again resumes forwarding what waited. One thread polls every
// socket; header-only.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

namespace muonmesh::testing {

class BlackholeProxy {
 public:
  // Proxies to 127.0.0.1:target_port; listens on a free loopback port.
  explicit BlackholeProxy(int target_port) : target_port_(target_port) {
    listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr = Loopback(0);
    if (listener_ < 0 || ::bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::listen(listener_, 64) != 0) {
      return;
    }
    socklen_t len = sizeof(addr);
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { Loop(); });
  }
  ~BlackholeProxy() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    for (const Pair& p : pairs_) {
      ::close(p.client);
      ::close(p.server);
    }
    if (listener_ >= 0) ::close(listener_);
  }
  BlackholeProxy(const BlackholeProxy&) = delete;
  BlackholeProxy& operator=(const BlackholeProxy&) = delete;

  // 0 when the proxy could not listen.
  int port() const { return port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

  void Block() { blocked_ = true; }
  void Open() { blocked_ = false; }
  // Connections accepted so far (a client that reconnects adds one).
  int accepted() const { return accepted_; }

 private:
  struct Pair {
    int client;
    int server;
  };

  static sockaddr_in Loopback(int port) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return addr;
  }

  void Accept() {
    const int client = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) return;
    const int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr = Loopback(target_port_);
    if (server < 0 || ::connect(server, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      ::close(client);
      if (server >= 0) ::close(server);
      return;
    }
    pairs_.push_back({client, server});
    ++accepted_;
  }

  // Moves what `from` has to `to`; false when either end closed.
  static bool Forward(int from, int to) {
    char buffer[65536];
    const ssize_t n = ::recv(from, buffer, sizeof(buffer), MSG_DONTWAIT);
    if (n == 0) return false;
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    for (ssize_t sent = 0; sent < n;) {
      const ssize_t k = ::send(to, buffer + sent, static_cast<size_t>(n - sent), MSG_NOSIGNAL);
      if (k < 0 && errno != EINTR && errno != EAGAIN) return false;
      if (k > 0) sent += k;
    }
    return true;
  }

  void Loop() {
    while (!stop_) {
      std::vector<pollfd> fds{{listener_, POLLIN, 0}};
      const size_t polled = blocked_ ? 0 : pairs_.size();
      for (size_t i = 0; i < polled; ++i) {
        fds.push_back({pairs_[i].client, POLLIN, 0});
        fds.push_back({pairs_[i].server, POLLIN, 0});
      }
      if (::poll(fds.data(), fds.size(), 20) <= 0) continue;
      std::vector<Pair> kept;
      for (size_t i = 0; i < polled; ++i) {
        const Pair& p = pairs_[i];
        bool alive = true;
        if (fds[1 + 2 * i].revents != 0) alive = Forward(p.client, p.server);
        if (alive && fds[2 + 2 * i].revents != 0) alive = Forward(p.server, p.client);
        if (alive) {
          kept.push_back(p);
        } else {
          ::close(p.client);
          ::close(p.server);
        }
      }
      for (size_t i = polled; i < pairs_.size(); ++i) kept.push_back(pairs_[i]);
      pairs_ = std::move(kept);
      if ((fds[0].revents & POLLIN) != 0) Accept();
    }
  }

  const int target_port_;
  int listener_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<bool> blocked_{false};
  std::atomic<int> accepted_{0};
  std::vector<Pair> pairs_;  // the loop thread's only
  std::thread thread_;
};

}  // namespace muonmesh::testing
