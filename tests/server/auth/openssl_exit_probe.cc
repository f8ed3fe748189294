// openssl_exit_probe ADDRESS CA_FILE TOKEN_FILE: connects to a TLS
// coordinator as muonmeshctl does, then returns from main(). Its own exit
// handler, registered before anything touches OpenSSL and so run after
// every handler registered later, exits 3 if OpenSSL's global state was
// freed by then: that happens when OpenSSL registered its exit handler,
// which races gRPC's threads still freeing TLS objects
// (credentials::InitOpenSslWithoutExitHandler). Exits 1 if it cannot connect.
//
// A program of its own because the order of exit handlers is per process:
// in a test binary another test may have initialised OpenSSL first.

#include <openssl/crypto.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <iostream>

#include "proto/credentials/credentials.h"

namespace {

void CheckOpenSslStillUp() {
  if (OPENSSL_init_crypto(0, nullptr) == 1) return;
  static constexpr char kMessage[] =
      "openssl_exit_probe: OpenSSL's exit handler freed its state before the process ended\n";
  (void)!write(STDERR_FILENO, kMessage, sizeof kMessage - 1);
  _exit(3);
}

}  // namespace

int main(int argc, char** argv) {
  std::atexit(CheckOpenSslStillUp);
  if (argc != 4) {
    std::cerr << "usage: openssl_exit_probe ADDRESS CA_FILE TOKEN_FILE\n";
    return 2;
  }
  muonmesh::credentials::ClientSecurityOptions options;
  options.tls_ca = argv[2];
  options.token_file = argv[3];
  absl::StatusOr<muonmesh::credentials::ChannelSecurity> security =
      muonmesh::credentials::LoadChannelSecurity(options);
  if (!security.ok()) {
    std::cerr << "openssl_exit_probe: " << security.status().message() << "\n";
    return 1;
  }
  const bool connected =
      muonmesh::credentials::CreateChannel(argv[1], *security)
          ->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(20));
  std::cout << (connected ? "connected over TLS\n" : "not connected\n");
  return connected ? 0 : 1;
}
