#pragma once

// The roles a bearer token grants (README "Security"):
//   viewer     reads: jobs, their events and metrics, the fleet, the Planner
//   submitter  what a viewer may, and submits and cancels jobs
//   worker     the Fleet (register, heartbeat, assignments, reports) and the
//              rendezvous Store
//   admin      everything

#include <cstdint>
#include <initializer_list>
#include <optional>

#include "absl/strings/string_view.h"

namespace muonmesh::auth {

enum class Role : uint8_t { kViewer, kSubmitter, kWorker, kAdmin };

inline constexpr Role kAllRoles[] = {Role::kViewer, Role::kSubmitter, Role::kWorker,
                                     Role::kAdmin};

inline absl::string_view RoleName(Role role) {
  switch (role) {
    case Role::kViewer:
      return "viewer";
    case Role::kSubmitter:
      return "submitter";
    case Role::kWorker:
      return "worker";
    case Role::kAdmin:
      return "admin";
  }
  return "unknown";
}

inline std::optional<Role> ParseRole(absl::string_view name) {
  for (const Role role : kAllRoles) {
    if (RoleName(role) == name) return role;
  }
  return std::nullopt;
}

// A set of roles, one bit each.
class RoleSet {
 public:
  constexpr RoleSet() = default;
  constexpr RoleSet(std::initializer_list<Role> roles) {
    for (const Role r : roles) bits_ |= Bit(r);
  }
  constexpr bool Has(Role role) const { return (bits_ & Bit(role)) != 0; }
  constexpr bool empty() const { return bits_ == 0; }
  constexpr bool operator==(const RoleSet&) const = default;

 private:
  static constexpr uint8_t Bit(Role r) { return static_cast<uint8_t>(1u << static_cast<int>(r)); }
  uint8_t bits_ = 0;
};

}  // namespace muonmesh::auth
