// The address a worker advertises when not told one: the local end of the
// route toward the coordinator, checked against the machine's own
// interfaces (getifaddrs), not against the code's arithmetic.

#include "worker/local_address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace muonmesh::worker {
namespace {

using ::testing::HasSubstr;

// This machine's IPv4 addresses, loopback aside.
std::vector<std::string> OwnAddresses() {
  std::vector<std::string> out;
  ifaddrs* all = nullptr;
  if (getifaddrs(&all) != 0) return out;
  for (ifaddrs* a = all; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, text,
              sizeof(text));
    if (std::string(text).rfind("127.", 0) != 0) out.push_back(text);
  }
  freeifaddrs(all);
  return out;
}

TEST(LocalAddressTest, TowardALocalCoordinatorItIsLoopback) {
  EXPECT_EQ(*LocalAddressToward("127.0.0.1:50051"), "127.0.0.1");
  EXPECT_EQ(*LocalAddressToward("dns:///127.0.0.1:50051"), "127.0.0.1");
  EXPECT_EQ(*LocalAddressToward("unix:/tmp/coordinator.sock"), "127.0.0.1");
  absl::StatusOr<std::string> v6 = LocalAddressToward("[::1]:50051");
  if (v6.ok()) {
    EXPECT_EQ(*v6, "::1");  // where IPv6 is configured at all
  }
}

// Toward an address of one of this machine's interfaces, the kernel routes
// from that interface: the worker advertises what its peers on that network
// can dial.
TEST(LocalAddressTest, TowardAnotherNetworkItIsThatInterfacesAddress) {
  const std::vector<std::string> own = OwnAddresses();
  if (own.empty()) GTEST_SKIP() << "this machine has no IPv4 address besides loopback";
  for (const std::string& address : own) {
    absl::StatusOr<std::string> local = LocalAddressToward(address + ":50051");
    ASSERT_TRUE(local.ok()) << local.status();
    EXPECT_EQ(*local, address);
  }
}

TEST(LocalAddressTest, ABadTargetIsNamed) {
  absl::StatusOr<std::string> no_port = LocalAddressToward("coordinator");
  EXPECT_EQ(no_port.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(no_port.status().message()), HasSubstr("'coordinator'"));
  absl::StatusOr<std::string> unknown = LocalAddressToward("no-such-host.invalid:50051");
  EXPECT_FALSE(unknown.ok());
  EXPECT_THAT(std::string(unknown.status().message()), HasSubstr("no-such-host.invalid"));
}

}  // namespace
}  // namespace muonmesh::worker
