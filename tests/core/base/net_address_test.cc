// Loopback addresses and gRPC peer hosts (core/base/net_address.h), against
// the standards' ranges written out here.

#include "core/base/net_address.h"

#include "gtest/gtest.h"

namespace muonmesh {
namespace {

TEST(NetAddressTest, LoopbackIsLocalhost127Slash8AndColonColon1) {
  for (const char* loopback : {"localhost", "LOCALHOST", "127.0.0.1", "127.255.0.9", "::1",
                               "[::1]", "::ffff:127.0.0.1"}) {
    EXPECT_TRUE(IsLoopbackAddress(loopback)) << loopback;
  }
  // Wildcards are every interface, not this machine alone.
  for (const char* other : {"10.0.0.5", "128.0.0.1", "0.0.0.0", "::", "[::]", "fe80::1",
                            "::ffff:10.0.0.1", "node3.example", "", "127.0.0.1.example",
                            "localhost.example.com"}) {
    EXPECT_FALSE(IsLoopbackAddress(other)) << other;
  }
}

TEST(NetAddressTest, PeerHostTakesTheAddressOffGrpcsPeerString) {
  EXPECT_EQ(PeerHost("ipv4:10.0.0.5:41234"), "10.0.0.5");
  EXPECT_EQ(PeerHost("ipv4:127.0.0.1:1"), "127.0.0.1");
  EXPECT_EQ(PeerHost("ipv6:[::1]:41234"), "::1");
  EXPECT_EQ(PeerHost("ipv6:[fe80::1%eth0]:9"), "fe80::1%eth0");
  EXPECT_EQ(PeerHost("unix:/tmp/socket"), "");
  EXPECT_EQ(PeerHost(""), "");
}

}  // namespace
}  // namespace muonmesh
