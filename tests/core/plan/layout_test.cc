#include "core/plan/layout.h"

#include <algorithm>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace muonmesh::plan {
namespace {

int64_t Total(const std::vector<LayoutTensor>& ts) {
  int64_t n = 0;
  for (const auto& t : ts) n += t.rows * t.row_len;
  return n;
}

// Independent check at element level: materialise the padded flat buffer as
// (tensor, element) labels and verify that every element of every tensor is
// in exactly one place, shards do not overlap, and no row is split.
void CheckElementLevel(const std::vector<LayoutTensor>& ts, const UnitLayout& l) {
  const int64_t d = l.num_shards;
  const int64_t s = l.shard_elements;
  ASSERT_EQ(static_cast<int64_t>(l.shard_begin.size()), d + 1);
  std::vector<std::pair<int32_t, int64_t>> buffer(d * s, {-1, -1});
  for (int64_t shard = 0; shard < d; ++shard) {
    for (int64_t i = l.shard_begin[shard]; i < l.shard_begin[shard + 1]; ++i) {
      const Segment& seg = l.segments[i];
      const LayoutTensor& t = ts[seg.tensor];
      ASSERT_GE(seg.row_start, 0);
      ASSERT_LE(seg.row_start + seg.row_count, t.rows);
      ASSERT_GE(seg.offset, 0);
      ASSERT_LE(seg.offset + seg.row_count * t.row_len, s) << "segment runs past its shard";
      for (int64_t e = 0; e < seg.row_count * t.row_len; ++e) {
        auto& slot = buffer[shard * s + seg.offset + e];
        ASSERT_EQ(slot.first, -1) << "two segments overlap";
        slot = {seg.tensor, seg.row_start * t.row_len + e};
      }
    }
  }
  // Each element exactly once; the shard of each row is unique.
  std::vector<std::vector<int64_t>> shard_of(ts.size());
  for (size_t t = 0; t < ts.size(); ++t) shard_of[t].assign(ts[t].rows * ts[t].row_len, -1);
  for (int64_t pos = 0; pos < d * s; ++pos) {
    const auto [t, e] = buffer[pos];
    if (t < 0) continue;
    ASSERT_EQ(shard_of[t][e], -1) << "element stored twice";
    shard_of[t][e] = pos / s;
  }
  for (size_t t = 0; t < ts.size(); ++t) {
    for (int64_t e = 0; e < ts[t].rows * ts[t].row_len; ++e) {
      ASSERT_GE(shard_of[t][e], 0) << "tensor " << t << " element " << e << " missing";
      // Row alignment: every element of a row sits in the row's first element's shard.
      ASSERT_EQ(shard_of[t][e], shard_of[t][e - e % ts[t].row_len]) << "row split";
    }
  }
  EXPECT_EQ(l.padding_elements, d * s - Total(ts));
}

// Smallest S for which the tensors, in order, split into d shards of at most
// S elements with cuts only at row boundaries, by brute force over S.
int64_t BruteForceOrderedMinimum(const std::vector<LayoutTensor>& ts, int64_t d) {
  // Cut points in element order, row-aligned.
  std::vector<int64_t> cuts = {0};
  int64_t at = 0;
  for (const auto& t : ts) {
    for (int64_t r = 0; r < t.rows; ++r) {
      at += t.row_len;
      cuts.push_back(at);
    }
  }
  for (int64_t s = 1;; ++s) {
    int64_t start = 0;
    int64_t pieces = 0;
    size_t i = 0;
    while (start < at && pieces < d) {
      while (i + 1 < cuts.size() && cuts[i + 1] - start <= s) ++i;
      if (cuts[i] == start) break;  // one row does not fit
      start = cuts[i];
      ++pieces;
    }
    if (start == at) return s;
  }
}

TEST(LayoutTest, HandComputedSmallUnit) {
  // A 3x4 matrix then a 5-element vector on 2 shards: 17 elements, a shard
  // needs >= 9; S = 9 holds 2 rows + 1 element, then 1 row + 4 elements.
  const std::vector<LayoutTensor> ts = {{0, 3, 4}, {1, 5, 1}};
  absl::StatusOr<UnitLayout> l = LayoutUnit(ts, 2);
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->shard_elements, 9);
  EXPECT_EQ(l->padding_elements, 1);
  CheckElementLevel(ts, *l);
}

TEST(LayoutTest, OneShardHasNoPadding) {
  const std::vector<LayoutTensor> ts = {{0, 7, 13}, {1, 3, 1}, {2, 11, 5}};
  absl::StatusOr<UnitLayout> l = LayoutUnit(ts, 1);
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->padding_elements, 0);
  EXPECT_EQ(l->shard_elements, Total(ts));
}

TEST(LayoutTest, MoreShardsThanRowsLeavesEmptyShards) {
  // 2 rows of 8 on 5 shards: a shard must hold a whole row, so S = 8 and
  // three shards stay empty.
  const std::vector<LayoutTensor> ts = {{0, 2, 8}};
  absl::StatusOr<UnitLayout> l = LayoutUnit(ts, 5);
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->shard_elements, 8);
  CheckElementLevel(ts, *l);
  int empty = 0;
  for (int s = 0; s < 5; ++s) empty += l->shard_begin[s] == l->shard_begin[s + 1];
  EXPECT_EQ(empty, 3);
}

TEST(LayoutTest, LongRowsLeaveOddRemaindersThatPackingAbsorbs) {
  // Rows of 7 and 2 at S = 16: in order, each shard of the 7-row matrix
  // holds 2 rows (14) and wastes 2; packed, shards take 2 long rows and one
  // short row. 8*7 + 4*2 = 64 elements on 4 shards fit exactly in 16.
  const std::vector<LayoutTensor> ts = {{0, 8, 7}, {1, 4, 2}};
  absl::StatusOr<UnitLayout> l = LayoutUnit(ts, 4);
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->shard_elements, 16);
  EXPECT_EQ(l->padding_elements, 0);
  EXPECT_EQ(l->method, "packed");
  CheckElementLevel(ts, *l);
}

TEST(LayoutTest, RejectsBadInput) {
  EXPECT_FALSE(LayoutUnit(std::vector<LayoutTensor>{{0, 1, 1}}, 0).ok());
  EXPECT_FALSE(LayoutUnit(std::vector<LayoutTensor>{{0, 0, 4}}, 2).ok());
}

TEST(LayoutTest, RandomUnitsHoldInvariantsAndBeatOrderedOptimumAndLcm) {
  std::mt19937_64 rng(1234);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<LayoutTensor> ts;
    const int n = 1 + static_cast<int>(rng() % 6);
    for (int i = 0; i < n; ++i) {
      const bool matrix = rng() % 3 != 0;
      ts.push_back({i, 1 + static_cast<int64_t>(rng() % (matrix ? 12 : 40)),
                    matrix ? 1 + static_cast<int64_t>(rng() % 9) : 1});
    }
    const int64_t d = 1 + static_cast<int64_t>(rng() % 9);
    absl::StatusOr<UnitLayout> l = LayoutUnit(ts, d);
    ASSERT_TRUE(l.ok());
    SCOPED_TRACE(testing::Message() << "trial " << trial << " d " << d);
    CheckElementLevel(ts, *l);
    EXPECT_LE(l->shard_elements, BruteForceOrderedMinimum(ts, d));
    EXPECT_LE(l->padding_elements, MegatronLcmPadding(ts, d));
    // Deterministic.
    absl::StatusOr<UnitLayout> again = LayoutUnit(ts, d);
    ASSERT_TRUE(again.ok());
    ASSERT_EQ(again->segments.size(), l->segments.size());
    for (size_t i = 0; i < l->segments.size(); ++i) {
      EXPECT_EQ(again->segments[i].offset, l->segments[i].offset);
      EXPECT_EQ(again->segments[i].row_start, l->segments[i].row_start);
    }
  }
}

TEST(LayoutTest, MegatronLcmRuleByHand) {
  // Rows of 4 and 6 (LCM 12), 2 shards: 8*4 = 32 elements, aligned start of
  // the second matrix at 32 (a multiple of 6? no: 36), 36 + 6*6 = 72; 72/2 =
  // 36, a multiple of 12: padding 72 - 68 = 4.
  const std::vector<LayoutTensor> ts = {{0, 8, 4}, {1, 6, 6}};
  EXPECT_EQ(MegatronLcmPadding(ts, 2), 4);
}

}  // namespace
}  // namespace muonmesh::plan

namespace muonmesh::plan {
namespace {

// The rotation's two directions, against the definition in types.h:
// shard k lives at position (k + rotation) mod D.
TEST(UnitLayoutRotationTest, ShardAtAndPositionOfFollowTheDefinition) {
  for (int64_t d : {1, 2, 3, 7, 8}) {
    for (int64_t rotation = 0; rotation < d; ++rotation) {
      UnitLayout l;
      l.num_shards = d;
      l.rotation = rotation;
      std::vector<int> seen(static_cast<size_t>(d), 0);
      for (int64_t k = 0; k < d; ++k) {
        int64_t position = k;
        for (int64_t r = 0; r < rotation; ++r) position = position + 1 == d ? 0 : position + 1;
        EXPECT_EQ(l.PositionOf(k), position) << "D=" << d << " rotation=" << rotation;
        EXPECT_EQ(l.ShardAt(position), k) << "D=" << d << " rotation=" << rotation;
        ++seen[static_cast<size_t>(l.ShardAt(k))];
      }
      for (int c : seen) EXPECT_EQ(c, 1);  // every shard at exactly one position
    }
  }
}

}  // namespace
}  // namespace muonmesh::plan

namespace muonmesh::plan {
namespace {

// Against a row-by-row count on small ranges.
TEST(IntersectRowsTest, MatchesCountingRowByRow) {
  for (int64_t lo = 0; lo < 6; ++lo) {
    for (int64_t hi = lo; hi < 8; ++hi) {
      for (int64_t start = 0; start < 8; ++start) {
        for (int64_t count = 0; count < 6; ++count) {
          int64_t first = -1, n = 0;
          for (int64_t row = start; row < start + count; ++row) {
            if (row >= lo && row < hi) {
              if (first < 0) first = row;
              ++n;
            }
          }
          const RowRange r = IntersectRows(lo, hi, start, count);
          EXPECT_EQ(r.count, n) << lo << " " << hi << " " << start << " " << count;
          if (n > 0) {
            EXPECT_EQ(r.start, first);
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace muonmesh::plan
