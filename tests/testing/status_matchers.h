#pragma once

// ASSERT_OK_AND_ASSIGN(lhs, expr): the test's form of
// MUONMESH_ASSIGN_OR_RETURN. Evaluates the absl::StatusOr expression once;
// a value is moved into `lhs` (a declaration or an lvalue), an error fails
// the test at once with the status printed.
//
//   ASSERT_OK_AND_ASSIGN(plan::Plan plan, plan::MakePlan(input));

#include <utility>

#include "gtest/gtest.h"

#define MUONMESH_TESTING_CONCAT_INNER_(a, b) a##b
#define MUONMESH_TESTING_CONCAT_(a, b) MUONMESH_TESTING_CONCAT_INNER_(a, b)

#define ASSERT_OK_AND_ASSIGN(lhs, expr) \
  MUONMESH_ASSERT_OK_AND_ASSIGN_IMPL_(MUONMESH_TESTING_CONCAT_(muonmesh_or_, __LINE__), lhs, expr)

#define MUONMESH_ASSERT_OK_AND_ASSIGN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                        \
  ASSERT_TRUE(tmp.ok()) << tmp.status();                    \
  lhs = *std::move(tmp)
