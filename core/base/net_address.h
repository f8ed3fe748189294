#pragma once

// Addresses as workers advertise them and gRPC names peers, for the checks
// that keep a gang's ranks reachable from each other (a worker on another
// host advertising 127.0.0.1 would leave its peers dialling themselves).
//
// Pure functions; any thread may call them.

#include <string>

namespace muonmesh {

// Whether `address` (a host name or a numeric address, IPv6 bracketed or
// not) names only this machine: "localhost" (any case), 127.0.0.0/8, ::1 or
// ::ffff:127.x.y.z. Wildcards ("0.0.0.0", "::", "") and every other name
// are not. (The coordinator serves such an address without TLS; a worker
// on another host must not advertise one.)
bool IsLoopbackAddress(const std::string& address);

// The host of a gRPC peer string ("ipv4:10.0.0.5:41234" -> "10.0.0.5",
// "ipv6:[::1]:41234" -> "::1"); "" for a peer without one ("unix:...").
std::string PeerHost(const std::string& peer);

}  // namespace muonmesh
