// Expectations are written by hand from the format in client/json_writer.h,
// not captured from the writer's output.

#include "client/json_writer.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/wrappers.pb.h"
#include "gtest/gtest.h"
#include "muonmesh/v1/config.pb.h"
#include "muonmesh/v1/fleet.pb.h"
#include "muonmesh/v1/planner.pb.h"

namespace muonmesh::client {
namespace {

TEST(JsonWriterTest, NestedRepeatedAndZeroFields) {
  v1::Matrix m;
  m.set_name("h.0.attn.c_attn.weight");
  m.set_rows(2304);
  m.set_cols(768);
  m.set_cost_flops(0.1);
  m.set_gather_bytes((int64_t{1} << 53) + 1);  // not representable as a double
  v1::Holder* h = m.add_holders();
  h->set_row_count(1152);
  h = m.add_holders();
  h->set_rank(1);
  h->set_row_start(1152);
  h->set_row_count(1152);
  EXPECT_EQ(ToJson(m),
            "{\n"
            "  \"name\": \"h.0.attn.c_attn.weight\",\n"
            "  \"rows\": 2304,\n"
            "  \"cols\": 768,\n"
            "  \"domain\": 0,\n"
            "  \"owner\": 0,\n"
            "  \"cost_flops\": 0.1,\n"
            "  \"owner_cost\": 0,\n"
            "  \"gather_bytes\": 9007199254740993,\n"
            "  \"owner_is_holder\": false,\n"
            "  \"holders\": [\n"
            "    {\n"
            "      \"rank\": 0,\n"
            "      \"row_start\": 0,\n"
            "      \"row_count\": 1152\n"
            "    },\n"
            "    {\n"
            "      \"rank\": 1,\n"
            "      \"row_start\": 1152,\n"
            "      \"row_count\": 1152\n"
            "    }\n"
            "  ],\n"
            "  \"ns_form\": \"\"\n"
            "}");
}

TEST(JsonWriterTest, RepeatedScalarsAreOneLineArrays) {
  v1::Mesh mesh;
  EXPECT_EQ(ToJson(mesh), "{\n  \"dim_names\": [],\n  \"shape\": []\n}");
  mesh.add_dim_names("dp_outer");
  mesh.add_dim_names("dp_shard");
  mesh.add_shape(2);
  mesh.add_shape(-4);
  EXPECT_EQ(ToJson(mesh),
            "{\n"
            "  \"dim_names\": [\"dp_outer\", \"dp_shard\"],\n"
            "  \"shape\": [2, -4]\n"
            "}");
}

TEST(JsonWriterTest, UnsetSubmessagesAndOptionalsAreLeftOut) {
  v1::PlanLayoutResponse empty;
  EXPECT_EQ(ToJson(empty), "{}");
  v1::PlanLayoutResponse with_plan;
  with_plan.mutable_plan()->mutable_summary()->set_ns_steps(5);
  const std::string json = ToJson(with_plan);
  EXPECT_NE(json.find("\"summary\": {"), std::string::npos) << json;
  EXPECT_NE(json.find("\"ns_steps\": 5,"), std::string::npos) << json;
  EXPECT_EQ(json.find("dense_mesh"), std::string::npos) << json;  // never set

  // proto3 `optional`: absent when unset, written when set, even to false.
  v1::MuonConfig muon;
  const std::string unset =
      "{\n"
      "  \"lr\": 0,\n"
      "  \"momentum\": 0,\n"
      "  \"ns_steps\": 0,\n"
      "  \"weight_decay\": 0,\n"
      "  \"scale\": \"\",\n"
      "  \"coefficients\": \"\",\n"
      "  \"ns_algorithm\": \"\",\n"
      "  \"split_qkv\": false,\n"
      "  \"per_head\": false\n"
      "}";
  EXPECT_EQ(ToJson(muon), unset);
  muon.set_nesterov(false);
  EXPECT_EQ(ToJson(muon),
            "{\n"
            "  \"lr\": 0,\n"
            "  \"momentum\": 0,\n"
            "  \"nesterov\": false,\n"
            "  \"ns_steps\": 0,\n"
            "  \"weight_decay\": 0,\n"
            "  \"scale\": \"\",\n"
            "  \"coefficients\": \"\",\n"
            "  \"ns_algorithm\": \"\",\n"
            "  \"split_qkv\": false,\n"
            "  \"per_head\": false\n"
            "}");

  // A oneof writes only its set member.
  v1::InitConfig init;
  init.set_seed(7);
  EXPECT_EQ(ToJson(init), "{\n  \"seed\": 7\n}");
}

TEST(JsonWriterTest, FieldNumberOrderAndEnumNames) {
  // descriptor.proto declares these out of number order (extendee = 2 comes
  // after type_name = 6).
  google::protobuf::FieldDescriptorProto field;
  field.set_json_name("jf");                                                // 10
  field.mutable_options();                                                  // 8
  field.set_extendee(".x");                                                 // 2
  field.set_type(google::protobuf::FieldDescriptorProto::TYPE_INT64);       // 5
  field.set_label(google::protobuf::FieldDescriptorProto::LABEL_REPEATED);  // 4
  field.set_number(3);                                                      // 3
  field.set_name("f");                                                      // 1
  EXPECT_EQ(ToJson(field),
            "{\n"
            "  \"name\": \"f\",\n"
            "  \"extendee\": \".x\",\n"
            "  \"number\": 3,\n"
            "  \"label\": \"LABEL_REPEATED\",\n"
            "  \"type\": \"TYPE_INT64\",\n"
            "  \"options\": {\n"
            "    \"uninterpreted_option\": []\n"  // repeated: always written
            "  },\n"
            "  \"json_name\": \"jf\"\n"
            "}");
}

// With short_enum_names each value loses the prefix its type's values all
// share: "LABEL_REPEATED" is "REPEATED", "TYPE_INT64" is "INT64"; a job's
// state is written as muonmeshctl's tables name it.
TEST(JsonWriterTest, ShortEnumNamesDropTheSharedPrefix) {
  google::protobuf::FieldDescriptorProto field;
  field.set_type(google::protobuf::FieldDescriptorProto::TYPE_INT64);
  field.set_label(google::protobuf::FieldDescriptorProto::LABEL_REPEATED);
  JsonOptions options;
  options.short_enum_names = true;
  EXPECT_EQ(ToJson(field, options),
            "{\n"
            "  \"label\": \"REPEATED\",\n"
            "  \"type\": \"INT64\"\n"
            "}");
  v1::WorkerInfo info;
  EXPECT_EQ(ToJson(info), ToJson(info, options));  // no enum: the same bytes
}

TEST(JsonWriterTest, MapsAreSortedObjects) {
  google::protobuf::Struct s;
  (*s.mutable_fields())["b"].set_number_value(1.5);
  (*s.mutable_fields())["a"].set_string_value("x\"y\n\t\\\x01");
  (*s.mutable_fields())["c"].mutable_list_value();
  EXPECT_EQ(ToJson(s),
            "{\n"
            "  \"fields\": {\n"
            "    \"a\": {\n"
            "      \"string_value\": \"x\\\"y\\n\\t\\\\\\u0001\"\n"
            "    },\n"
            "    \"b\": {\n"
            "      \"number_value\": 1.5\n"
            "    },\n"
            "    \"c\": {\n"
            "      \"list_value\": {\n"
            "        \"values\": []\n"
            "      }\n"
            "    }\n"
            "  }\n"
            "}");
}

std::string DoubleJson(double v) {
  google::protobuf::DoubleValue w;
  w.set_value(v);
  const std::string json = ToJson(w);
  const std::string prefix = "{\n  \"value\": ";
  EXPECT_EQ(json.substr(0, prefix.size()), prefix);
  return json.substr(prefix.size(), json.size() - prefix.size() - 2);
}

TEST(JsonWriterTest, NumbersRoundTripAndStayNumbers) {
  EXPECT_EQ(DoubleJson(0), "0");
  EXPECT_EQ(DoubleJson(-0.0), "-0");
  EXPECT_EQ(DoubleJson(42), "42");
  EXPECT_EQ(DoubleJson(123456789012345.0), "123456789012345");
  EXPECT_EQ(DoubleJson(1e15), "1e+15");
  EXPECT_EQ(DoubleJson(0.1), "0.1");
  EXPECT_EQ(DoubleJson(2.5e-7), "2.5e-07");
  EXPECT_EQ(DoubleJson(1.0 / 3.0), "0.3333333333333333");
  EXPECT_EQ(DoubleJson(0.1 + 0.2), "0.30000000000000004");
  EXPECT_EQ(DoubleJson(1e300), "1e+300");
  EXPECT_EQ(DoubleJson(std::nan("")), "\"NaN\"");
  EXPECT_EQ(DoubleJson(-std::numeric_limits<double>::infinity()), "\"-Infinity\"");

  google::protobuf::Int64Value i64;
  i64.set_value(std::numeric_limits<int64_t>::min());
  EXPECT_EQ(ToJson(i64), "{\n  \"value\": -9223372036854775808\n}");
  google::protobuf::UInt64Value u64;
  u64.set_value(std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(ToJson(u64), "{\n  \"value\": 18446744073709551615\n}");
  google::protobuf::FloatValue f;
  f.set_value(0.1f);
  EXPECT_EQ(ToJson(f), "{\n  \"value\": 0.1\n}");
  google::protobuf::BytesValue b;
  b.set_value(std::string("\x00\xff", 2));
  EXPECT_EQ(ToJson(b), "{\n  \"value\": \"AP8=\"\n}");
}

TEST(JsonWriterTest, OmittedFieldsAreLeftOut) {
  v1::DomainSummary d;
  d.set_makespan(2);
  EXPECT_EQ(ToJson(d, {.omit_fields = {"muonmesh.v1.DomainSummary.lower_bound",
                                       "muonmesh.v1.DomainSummary.domain"}}),
            "{\n"
            "  \"makespan\": 2,\n"
            "  \"matrices\": 0\n"
            "}");
}

TEST(JsonWriterTest, SameMessageSameBytes) {
  v1::Plan plan;
  plan.set_world_size(8);
  for (int r = 0; r < 8; ++r) plan.add_ranks()->set_rank(r);
  v1::Plan copy;
  ASSERT_TRUE(copy.ParseFromString(plan.SerializeAsString()));
  EXPECT_EQ(ToJson(plan), ToJson(copy));
}

}  // namespace
}  // namespace muonmesh::client
