#pragma once

// The address a worker advertises to its peers when it is not told one
// (muonmesh-worker --address): the local address this host uses to reach
// the coordinator, as the kernel's routing picks it. On one host that is
// 127.0.0.1; across hosts it is the interface facing the coordinator's
// network, which the peers on that network reach too.
//
// Free functions; any thread may call them.

#include <string>

#include "absl/status/statusor.h"

namespace muonmesh::worker {

// The numeric local address (IPv4 or IPv6, no brackets) of a UDP socket
// connected toward `target` ("HOST:PORT", "[V6]:PORT", "dns:///HOST:PORT";
// connecting a UDP socket sends nothing). "127.0.0.1" for a "unix:" target.
// InvalidArgument naming `target` when it has no port, NotFound when its
// host does not resolve, Unavailable when no route leads there.
absl::StatusOr<std::string> LocalAddressToward(const std::string& target);

}  // namespace muonmesh::worker
