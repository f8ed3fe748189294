#include "worker/local_address.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace muonmesh::worker {
namespace {

struct HostPort {
  std::string host, port;
};

absl::StatusOr<HostPort> Split(std::string target) {
  if (absl::StartsWith(target, "dns:///")) target = target.substr(7);
  if (absl::StartsWith(target, "ipv4:") || absl::StartsWith(target, "ipv6:")) {
    target = target.substr(5);
  }
  if (!target.empty() && target.front() == '[') {
    const size_t close = target.find(']');
    if (close != std::string::npos && close + 1 < target.size() && target[close + 1] == ':') {
      return HostPort{target.substr(1, close - 1), target.substr(close + 2)};
    }
  } else if (const size_t colon = target.rfind(':');
             colon != std::string::npos && colon > 0 && target.find(':') == colon) {
    return HostPort{target.substr(0, colon), target.substr(colon + 1)};
  }
  return absl::InvalidArgumentError(
      absl::StrCat("coordinator address '", target.substr(0, 200), "': not HOST:PORT"));
}

// Closes the socket on every path.
struct Socket {
  int fd = -1;
  ~Socket() {
    if (fd >= 0) close(fd);
  }
};

}  // namespace

absl::StatusOr<std::string> LocalAddressToward(const std::string& target) {
  if (absl::StartsWith(target, "unix:")) return std::string("127.0.0.1");
  absl::StatusOr<HostPort> hp = Split(target);
  if (!hp.ok()) return hp.status();
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(hp->host.c_str(), hp->port.c_str(), &hints, &found); rc != 0) {
    return absl::NotFoundError(
        absl::StrCat("coordinator address '", target, "': ", gai_strerror(rc)));
  }
  std::string why = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    Socket s{socket(a->ai_family, SOCK_DGRAM, 0)};
    if (s.fd < 0 || connect(s.fd, a->ai_addr, a->ai_addrlen) != 0) {
      why = std::strerror(errno);
      continue;
    }
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (getsockname(s.fd, reinterpret_cast<sockaddr*>(&local), &len) != 0) {
      why = std::strerror(errno);
      continue;
    }
    char text[INET6_ADDRSTRLEN] = {};
    const void* raw = local.ss_family == AF_INET
                          ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr)
                          : static_cast<const void*>(
                                &reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr);
    if (inet_ntop(local.ss_family, raw, text, sizeof(text)) == nullptr) {
      why = std::strerror(errno);
      continue;
    }
    freeaddrinfo(found);
    return std::string(text);
  }
  freeaddrinfo(found);
  return absl::UnavailableError(
      absl::StrCat("no route from this host to the coordinator at ", target, ": ", why));
}

}  // namespace muonmesh::worker
