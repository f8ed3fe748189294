// The one way muonmesh code passes an error up: MUONMESH_RETURN_IF_ERROR and
// MUONMESH_ASSIGN_OR_RETURN.
//
//   MUONMESH_RETURN_IF_ERROR(file.Close());
//   MUONMESH_RETURN_IF_ERROR(LoadShards(dir), "checkpoint ", dir);
//
// evaluates an absl::Status expression once and, when it is not OK, returns
// it from the enclosing function (which returns absl::Status or
// absl::StatusOr<T>). Extra arguments are the context: they are joined with
// absl::StrCat and put in front of the message as "context: message"; the
// code and every payload (google.rpc details, field violations) are kept.
//
//   MUONMESH_ASSIGN_OR_RETURN(Header header, ReadHeader(path));
//   MUONMESH_ASSIGN_OR_RETURN(spec_, LoadSpec(file), "model spec ", file);
//
// evaluates an absl::StatusOr<T> expression once; an error returns as above,
// a value is moved into the left-hand side (a declaration or an lvalue). The
// left-hand side must not contain a top-level comma. One statement: do not
// use it as the body of an unbraced if or loop.
//
// Header-only, Abseil only: the planner (a leaf library) uses it too.
#ifndef MUONMESH_CORE_BASE_STATUS_MACROS_H_
#define MUONMESH_CORE_BASE_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace muonmesh {

// `status` with "context: " in front of its message, the same code and the
// same payloads; OK and an empty context come back unchanged.
inline absl::Status AnnotateStatus(absl::Status status, absl::string_view context) {
  if (status.ok() || context.empty()) return status;
  absl::Status annotated(status.code(), absl::StrCat(context, ": ", status.message()));
  status.ForEachPayload([&](absl::string_view type_url, const absl::Cord& payload) {
    annotated.SetPayload(type_url, payload);
  });
  return annotated;
}

namespace status_macros_internal {

// The context of MUONMESH_RETURN_IF_ERROR: nothing, or its extra arguments
// joined. Only built on the error path.
inline absl::Status Annotate(absl::Status status) { return status; }
template <typename... Parts>
absl::Status Annotate(absl::Status status, const Parts&... parts) {
  return AnnotateStatus(std::move(status), absl::StrCat(parts...));
}

}  // namespace status_macros_internal
}  // namespace muonmesh

#define MUONMESH_RETURN_IF_ERROR(expr, ...)                                     \
  do {                                                                          \
    if (::absl::Status muonmesh_status_macro_ = (expr);                         \
        !muonmesh_status_macro_.ok()) {                                         \
      return ::muonmesh::status_macros_internal::Annotate(                     \
          std::move(muonmesh_status_macro_) __VA_OPT__(, ) __VA_ARGS__);        \
    }                                                                           \
  } while (0)

#define MUONMESH_STATUS_MACROS_CONCAT_INNER_(a, b) a##b
#define MUONMESH_STATUS_MACROS_CONCAT_(a, b) MUONMESH_STATUS_MACROS_CONCAT_INNER_(a, b)

#define MUONMESH_ASSIGN_OR_RETURN(lhs, expr, ...)                                  \
  MUONMESH_ASSIGN_OR_RETURN_IMPL_(                                                 \
      MUONMESH_STATUS_MACROS_CONCAT_(muonmesh_status_or_, __LINE__), lhs,          \
      expr __VA_OPT__(, ) __VA_ARGS__)

#define MUONMESH_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr, ...)                       \
  auto tmp = (expr);                                                               \
  if (!tmp.ok()) {                                                                 \
    return ::muonmesh::status_macros_internal::Annotate(                          \
        std::move(tmp).status() __VA_OPT__(, ) __VA_ARGS__);                       \
  }                                                                                \
  lhs = *std::move(tmp)

#endif  // MUONMESH_CORE_BASE_STATUS_MACROS_H_
