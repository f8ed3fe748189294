// The Planner service behind a real grpc::Server on 127.0.0.1:0, called
// through the generated stub, with the coordinator's own server settings.

#include "server/planner_service.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/plan/plan_size.h"
#include "core/plan/validate.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/support/sync_stream.h"
#include "gtest/gtest.h"
#include "muonmesh/v1/jobs.grpc.pb.h"
#include "muonmesh/v1/planner.grpc.pb.h"
#include "proto/convert/plan_convert.h"
#include "proto/io/message_file.h"
#include "proto/rpc/rpc_status.h"
#include "server/coordinator_server.h"

#if MUONMESH_HAVE_HEALTH_PROTO
#include "grpc/health/v1/health.grpc.pb.h"
#endif

namespace muonmesh::coordinator {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

std::string SpecPath(const std::string& name) {
  return std::string(MUONMESH_SPECS_DIR) + "/" + name + ".json";
}

class PlannerServiceTest : public ::testing::Test {
 protected:
  void SetUp() override { StartServer({}); }

  // (Re)starts the server with these planner limits.
  void StartServer(const coordinator::PlannerServiceOptions& planner) {
    if (server_ != nullptr) {
      server_->Shutdown(absl::ZeroDuration());
      server_->Wait();
    }
    coordinator::CoordinatorServerOptions options;
    options.listen = "127.0.0.1:0";
    options.planner = planner;
    absl::StatusOr<std::unique_ptr<coordinator::CoordinatorServer>> server = coordinator::CoordinatorServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    ASSERT_GT(server_->port(), 0);
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(kMaxResponseBytes);
    channel_ =
        grpc::CreateCustomChannel(server_->address(), grpc::InsecureChannelCredentials(), args);
    stub_ = v1::Planner::NewStub(channel_);
  }

  void TearDown() override {
    if (server_ != nullptr) {
      server_->Shutdown(absl::Seconds(1));
      server_->Wait();
    }
  }

  // gpt2-124m from the shared specs, or skips the test when it is missing.
  v1::ModelSpec Gpt2() {
    v1::ModelSpec spec;
    const absl::Status st = protoio::LoadMessageFile(SpecPath("gpt2-124m"), &spec);
    if (!st.ok()) ADD_FAILURE() << st;
    return spec;
  }

  static void Deadline(grpc::ClientContext* context) {
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  }

  grpc::Status Plan(const v1::PlanLayoutRequest& request, v1::PlanLayoutResponse* response) {
    grpc::ClientContext context;
    Deadline(&context);
    return stub_->PlanLayout(&context, request, response);
  }

  grpc::Status Validate(const v1::ValidateConfigRequest& request,
                        v1::ValidateConfigResponse* response) {
    grpc::ClientContext context;
    Deadline(&context);
    return stub_->ValidateConfig(&context, request, response);
  }

  // A small valid plan request.
  static v1::PlanLayoutRequest SmallRequest() {
    v1::PlanLayoutRequest request;
    v1::ParamSpec* p = request.mutable_model()->add_units()->add_params();
    request.mutable_model()->mutable_units(0)->set_name("u");
    p->set_name("w");
    p->add_shape(64);
    p->add_shape(32);
    p->set_optimizer("muon");
    request.set_world_size(4);
    return request;
  }

  // A small valid call: the server is alive and answering correctly.
  void ExpectServing() {
    v1::PlanLayoutResponse response;
    const grpc::Status status = Plan(SmallRequest(), &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.plan().ranks_size(), 4);
  }

  // Waits (bounded) until the server computes `n` plans.
  void WaitForPlansInFlight(int64_t n) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (server_->planner().plans_in_flight() != n &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ASSERT_EQ(server_->planner().plans_in_flight(), n);
  }

  // google.rpc.Status from the trailer, parsed here rather than with the
  // helpers under test.
  static std::vector<std::string> DetailFields(const grpc::Status& status) {
    google::rpc::Status details;
    EXPECT_TRUE(details.ParseFromString(status.error_details()));
    EXPECT_EQ(details.code(), static_cast<int>(status.error_code()));
    EXPECT_EQ(details.details_size(), 1);
    std::vector<std::string> fields;
    for (const google::protobuf::Any& any : details.details()) {
      google::rpc::BadRequest bad_request;
      EXPECT_TRUE(any.UnpackTo(&bad_request)) << any.type_url();
      for (const auto& v : bad_request.field_violations()) {
        EXPECT_FALSE(v.description().empty()) << v.field();
        fields.push_back(v.field());
      }
    }
    return fields;
  }

  std::unique_ptr<coordinator::CoordinatorServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Planner::Stub> stub_;
};

TEST_F(PlannerServiceTest, PlansGpt2OnEightRanksWithHoldersTilingEveryMatrix) {
  v1::PlanLayoutRequest request;
  *request.mutable_model() = Gpt2();
  request.set_world_size(8);
  v1::PlanLayoutResponse response;
  const grpc::Status status = Plan(request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  const v1::Plan& plan = response.plan();

  EXPECT_EQ(plan.world_size(), 8);
  ASSERT_EQ(plan.ranks_size(), 8);
  for (int r = 0; r < 8; ++r) EXPECT_EQ(plan.ranks(r).rank(), r);
  EXPECT_GT(plan.summary().plan_seconds(), 0);

  // Expected matrices, from the spec: every Muon tensor as (shape[0], rest),
  // once, since the default ZeRO-3 makes all 8 ranks one domain.
  std::map<std::string, std::pair<int64_t, int64_t>> expected;
  int64_t parameters = 0;
  for (const v1::UnitSpec& unit : request.model().units()) {
    for (const v1::ParamSpec& p : unit.params()) {
      int64_t numel = 1;
      for (int64_t d : p.shape()) numel *= d;
      parameters += numel;
      if (p.optimizer() == "muon") expected[p.name()] = {p.shape(0), numel / p.shape(0)};
    }
  }
  ASSERT_FALSE(expected.empty());
  EXPECT_EQ(plan.summary().parameters(), parameters);
  ASSERT_EQ(plan.matrices_size(), static_cast<int>(expected.size()));

  for (const v1::Matrix& m : plan.matrices()) {
    SCOPED_TRACE(m.name());
    ASSERT_TRUE(expected.count(m.name()));
    EXPECT_EQ(m.rows(), expected[m.name()].first);
    EXPECT_EQ(m.cols(), expected[m.name()].second);
    // Holders tile the rows: sorted by start they are contiguous, non-empty,
    // on distinct ranks of the world, and cover [0, rows).
    std::vector<v1::Holder> holders(m.holders().begin(), m.holders().end());
    std::sort(holders.begin(), holders.end(), [](const v1::Holder& a, const v1::Holder& b) {
      return a.row_start() < b.row_start();
    });
    int64_t next = 0;
    std::set<int> ranks;
    for (const v1::Holder& h : holders) {
      EXPECT_EQ(h.row_start(), next);
      EXPECT_GT(h.row_count(), 0);
      EXPECT_GE(h.rank(), 0);
      EXPECT_LT(h.rank(), 8);
      EXPECT_TRUE(ranks.insert(h.rank()).second) << "rank " << h.rank() << " twice";
      next = h.row_start() + h.row_count();
    }
    EXPECT_EQ(next, m.rows());
    // The owner is a rank of the domain; LPT may pick a non-holder when
    // that finishes sooner (core/plan/owners.h), and says so.
    EXPECT_GE(m.owner(), 0);
    EXPECT_LT(m.owner(), 8);
    EXPECT_EQ(m.owner_is_holder(), ranks.count(m.owner()) == 1) << "owner " << m.owner();
  }
}

// omit_holders: the same plan without Matrix.holders (owner_is_holder kept),
// and a smaller answer.
TEST_F(PlannerServiceTest, OmitHoldersLeavesOnlyTheHoldersOut) {
  v1::PlanLayoutRequest request;
  *request.mutable_model() = Gpt2();
  request.set_world_size(8);
  v1::PlanLayoutResponse full, lean;
  ASSERT_TRUE(Plan(request, &full).ok());
  request.set_omit_holders(true);
  ASSERT_TRUE(Plan(request, &lean).ok());
  int64_t holders = 0;
  for (const v1::Matrix& m : full.plan().matrices()) holders += m.holders_size();
  ASSERT_GT(holders, 0);
  for (const v1::Matrix& m : lean.plan().matrices()) EXPECT_EQ(m.holders_size(), 0) << m.name();
  v1::Plan expected = full.plan();
  for (v1::Matrix& m : *expected.mutable_matrices()) m.clear_holders();
  expected.mutable_summary()->clear_plan_seconds();
  v1::Plan got = lean.plan();
  got.mutable_summary()->clear_plan_seconds();
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(expected, got));
  EXPECT_LT(lean.ByteSizeLong(), full.ByteSizeLong());
}

TEST_F(PlannerServiceTest, ValidateConfigAnswersOkWithEveryViolation) {
  v1::ValidateConfigRequest request;
  *request.mutable_model() = Gpt2();
  ASSERT_GT(request.model().units_size(), 1);
  request.mutable_model()->mutable_units(1)->mutable_params(0)->set_shape(0, 0);
  request.set_world_size(8);
  v1::ParallelismConfig* par = request.mutable_parallelism();
  par->set_data_parallel_sharding_strategy("zero9");
  par->set_num_distributed_optimizer_instances(3);
  par->set_expert_model_parallel_size(-1);
  par->set_tensor_model_parallel_size(2);
  request.mutable_options()->set_ns_steps(500);

  v1::ValidateConfigResponse response;
  const grpc::Status status = Validate(request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  std::vector<std::string> fields;
  for (const v1::FieldViolation& v : response.violations()) {
    EXPECT_FALSE(v.description().empty()) << v.field();
    fields.push_back(v.field());
  }
  EXPECT_THAT(fields,
              UnorderedElementsAre("parallelism.data_parallel_sharding_strategy",
                                   "parallelism.num_distributed_optimizer_instances",
                                   "parallelism.expert_model_parallel_size",
                                   "parallelism.tensor_model_parallel_size", "options.ns_steps",
                                   "model.units[1].params[0].shape[0]"));

  // And a valid config has none.
  v1::ValidateConfigRequest valid;
  *valid.mutable_model() = request.model();
  valid.mutable_model()->mutable_units(1)->mutable_params(0)->set_shape(0, 768);
  valid.set_world_size(8);
  v1::ValidateConfigResponse none;
  ASSERT_TRUE(Validate(valid, &none).ok());
  EXPECT_THAT(none.violations(), IsEmpty());
}

TEST_F(PlannerServiceTest, PlanLayoutOfInvalidConfigCarriesBadRequestDetails) {
  v1::PlanLayoutRequest request;
  *request.mutable_model() = Gpt2();
  ASSERT_GT(request.model().units_size(), 3);
  ASSERT_GT(request.model().units(3).params_size(), 2);
  ASSERT_EQ(request.model().units(3).params(2).shape_size(), 2);
  request.mutable_model()->mutable_units(3)->mutable_params(2)->set_shape(1, -768);
  request.set_world_size(-4);
  request.mutable_parallelism()->set_num_distributed_optimizer_instances(-2);

  v1::PlanLayoutResponse response;
  const grpc::Status status = Plan(request, &response);
  ASSERT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(DetailFields(status),
              UnorderedElementsAre("world_size", "parallelism.num_distributed_optimizer_instances",
                                   "model.units[3].params[2].shape[1]"));
  // The message lists them too, for clients that ignore details.
  EXPECT_THAT(status.error_message(), HasSubstr("world_size: must be >= 1, got -4"));
  EXPECT_THAT(status.error_message(),
              HasSubstr("parallelism.num_distributed_optimizer_instances: "));
  EXPECT_THAT(status.error_message(), HasSubstr("model.units[3].params[2].shape[1]: "));
  EXPECT_FALSE(response.has_plan());
}

// Far more violations than a trailer holds, with multi-byte names: the call
// still answers INVALID_ARGUMENT with parseable (valid UTF-8) details that
// say what was left out, and ValidateConfig still returns all of them.
TEST_F(PlannerServiceTest, ThousandsOfViolationsStillFitTheTrailer) {
  v1::PlanLayoutRequest request;
  constexpr int kUnits = 3000;
  // Two names taking turns, made of three-byte characters ("\u20ac"):
  // messages quote them, so a cut to size lands inside one.
  std::string name;
  for (int i = 0; i < 100; ++i) name += "\xE2\x82\xAC";
  for (int u = 0; u < kUnits; ++u) {
    request.mutable_model()->add_units()->set_name(u % 2 == 0 ? name : name + "!");
  }
  request.set_world_size(8);
  v1::PlanLayoutResponse response;
  const grpc::Status status = Plan(request, &response);
  ASSERT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_LE(status.error_message().size(), rpc::kMaxStatusMessageBytes);
  EXPECT_LE(status.error_details().size(), rpc::kMaxErrorDetailsBytes);
  const std::vector<std::string> fields = DetailFields(status);
  ASSERT_GE(fields.size(), 2u);
  EXPECT_LT(fields.size(), static_cast<size_t>(kUnits));
  EXPECT_EQ(fields.front(), "model.units[0].params");
  EXPECT_EQ(fields.back(), "");  // "N more violation(s) not shown"

  v1::ValidateConfigRequest validate;
  *validate.mutable_model() = request.model();
  validate.set_world_size(8);
  v1::ValidateConfigResponse all;
  ASSERT_TRUE(Validate(validate, &all).ok());
  // Every unit lacks parameters; every other one repeats a name.
  EXPECT_EQ(all.violations_size(), kUnits + kUnits - 2);
  ExpectServing();
}

// Inputs meant to break a server: each is refused with a clear code, and the
// server answers a normal call afterwards.
TEST_F(PlannerServiceTest, AbsurdRequestsAreRefusedAndTheServerKeepsServing) {
  const v1::ModelSpec gpt2 = Gpt2();
  struct Case {
    std::string name;
    v1::PlanLayoutRequest request;
    grpc::StatusCode code;
    std::string field;  // expected among the violations; empty: none
  };
  std::vector<Case> cases;
  auto add = [&cases](std::string name, grpc::StatusCode code, std::string field) -> auto& {
    cases.push_back({std::move(name), {}, code, std::move(field)});
    return cases.back().request;
  };
  auto one_matrix = [](v1::PlanLayoutRequest& r, std::vector<int64_t> shape) {
    v1::UnitSpec* unit = r.mutable_model()->add_units();
    unit->set_name("u");
    v1::ParamSpec* p = unit->add_params();
    p->set_name("w");
    for (int64_t d : shape) p->add_shape(d);
    p->set_optimizer("muon");
  };

  {
    auto& r = add("world size 2^40", grpc::StatusCode::INVALID_ARGUMENT, "world_size");
    *r.mutable_model() = gpt2;
    r.set_world_size(int64_t{1} << 40);
  }
  {
    auto& r =
        add("dims 2^62", grpc::StatusCode::INVALID_ARGUMENT, "model.units[0].params[0].shape");
    one_matrix(r, {int64_t{1} << 62, int64_t{1} << 62});
    r.set_world_size(8);
  }
  {
    auto& r = add("a million empty units", grpc::StatusCode::INVALID_ARGUMENT, "model.units");
    for (int u = 0; u < 1'000'000; ++u) r.mutable_model()->add_units();
    r.set_world_size(8);
  }
  {
    auto& r = add("ns_steps -5", grpc::StatusCode::INVALID_ARGUMENT, "options.ns_steps");
    *r.mutable_model() = gpt2;
    r.set_world_size(8);
    r.mutable_options()->set_ns_steps(-5);
  }
  {
    auto& r = add("extreme integers", grpc::StatusCode::INVALID_ARGUMENT,
                  "parallelism.num_distributed_optimizer_instances");
    one_matrix(r, {INT64_MAX, INT64_MIN, 0});
    r.set_world_size(INT64_MIN);
    r.mutable_parallelism()->set_num_distributed_optimizer_instances(INT64_MIN);
    r.mutable_parallelism()->set_expert_model_parallel_size(INT64_MAX);
    r.mutable_options()->set_ns_steps(INT32_MIN);
    r.mutable_options()->set_comm_flops_per_byte(-1e308);
  }
  {
    // Valid for the planner, but 2000 units x 2^20 shards is gigabytes.
    auto& r = add("many units on a huge world", grpc::StatusCode::INVALID_ARGUMENT, "world_size");
    for (int u = 0; u < 2000; ++u) {
      v1::UnitSpec* unit = r.mutable_model()->add_units();
      unit->set_name(absl::StrCat("u", u));
      v1::ParamSpec* p = unit->add_params();
      p->set_name(absl::StrCat("b", u));
      p->add_shape(1);
      p->set_optimizer("adamw");
    }
    r.set_world_size(plan::kMaxWorldSize);
  }
  {
    // DDP repeats every matrix in every rank's domain: ~12.6M matrix copies
    // are within the planner's limit but far over the response limit.
    auto& r = add("DDP on 2^18 ranks", grpc::StatusCode::RESOURCE_EXHAUSTED, "");
    *r.mutable_model() = gpt2;
    r.set_world_size(int64_t{1} << 18);
    r.mutable_parallelism()->set_data_parallel_sharding_strategy("no_shard");
  }
  {
    // Over the 64 MiB request limit: refused by gRPC before the handler.
    auto& r = add("65 MiB request", grpc::StatusCode::RESOURCE_EXHAUSTED, "");
    one_matrix(r, {4, 4});
    r.mutable_model()->mutable_units(0)->set_name(std::string(65 << 20, 'u'));
    r.set_world_size(8);
  }

  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    v1::PlanLayoutResponse response;
    const auto start = std::chrono::steady_clock::now();
    const grpc::Status status = Plan(c.request, &response);
    EXPECT_EQ(status.error_code(), c.code) << status.error_message();
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
    if (!c.field.empty()) {
      const std::vector<std::string> fields = DetailFields(status);
      EXPECT_NE(std::find(fields.begin(), fields.end(), c.field), fields.end())
          << status.error_message();
    }
    ExpectServing();
  }
}

TEST_F(PlannerServiceTest, HealthServiceReportsServing) {
#if MUONMESH_HAVE_HEALTH_PROTO
  auto health = grpc::health::v1::Health::NewStub(channel_);
  for (const std::string service : {"", "muonmesh.v1.Planner"}) {
    SCOPED_TRACE(service);
    grpc::ClientContext context;
    Deadline(&context);
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status status = health->Check(&context, request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  }
  // An unknown service is NOT_FOUND, so SERVING above is not a default.
  grpc::ClientContext context;
  Deadline(&context);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service("no.such.Service");
  grpc::health::v1::HealthCheckResponse response;
  EXPECT_EQ(health->Check(&context, request, &response).error_code(), grpc::StatusCode::NOT_FOUND);
#else
  GTEST_SKIP() << "grpc/health/v1/health.proto (package grpc-proto) not found at build time";
#endif
}

// Reflection (v1alpha: all gRPC 1.51 serves) lists our services. Its stubs
// must not be compiled into a binary that links grpc++_reflection (they
// would be defined twice), so the request is hand-encoded and sent as raw
// bytes on the same sync streaming API generated stubs use.
TEST_F(PlannerServiceTest, ReflectionListsTheServices) {
  grpc::ClientContext context;
  Deadline(&context);
  const grpc::internal::RpcMethod method(
      "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
      grpc::internal::RpcMethod::BIDI_STREAMING);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          channel_.get(), method, &context));
  // ServerReflectionRequest{list_services: "*"}: field 7, wire type 2.
  grpc::Slice slice(std::string("\x3a\x01*", 3));
  ASSERT_TRUE(stream->Write(grpc::ByteBuffer(&slice, 1)));
  ASSERT_TRUE(stream->WritesDone());
  grpc::ByteBuffer reply;
  ASSERT_TRUE(stream->Read(&reply));
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(reply.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  // The service names appear verbatim in the encoded ListServiceResponse.
  EXPECT_NE(bytes.find("muonmesh.v1.Planner"), std::string::npos);
  EXPECT_NE(bytes.find("grpc.health.v1.Health"), std::string::npos);
  while (stream->Read(&reply)) {
  }
  EXPECT_TRUE(stream->Finish().ok());
}

// Layers of ten [64, 64] Muon matrices on 128 ranks: seconds of owner
// refinement for 4000 layers, long enough to be seen in flight and stopped.
v1::PlanLayoutRequest SlowRequest(int units = 4000) {
  v1::PlanLayoutRequest request;
  request.set_world_size(128);
  for (int u = 0; u < units; ++u) {
    v1::UnitSpec* unit = request.mutable_model()->add_units();
    unit->set_name(absl::StrCat("u", u));
    for (int k = 0; k < 10; ++k) {
      v1::ParamSpec* p = unit->add_params();
      p->set_name(absl::StrCat("u", u, ".w", k));
      p->add_shape(64);
      p->add_shape(64);
      p->set_optimizer("muon");
    }
  }
  return request;
}

// A plan call on its own thread, cancellable by the test.
class BackgroundPlan {
 public:
  BackgroundPlan(v1::Planner::Stub* stub, const v1::PlanLayoutRequest& request) {
    context_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
    thread_ = std::thread([this, stub, &request] {
      status_ = stub->PlanLayout(&context_, request, &response_);
    });
  }
  ~BackgroundPlan() { Cancel(); }
  // Cancels the call (if still running) and waits for its status.
  const grpc::Status& Cancel() {
    if (thread_.joinable()) {
      context_.TryCancel();
      thread_.join();
    }
    return status_;
  }
  // Waits for the call's own end.
  const grpc::Status& Finish() {
    if (thread_.joinable()) thread_.join();
    return status_;
  }

 private:
  grpc::ClientContext context_;
  v1::PlanLayoutResponse response_;
  grpc::Status status_;
  std::thread thread_;
};

// N plans in flight, and an N+1st is refused at once; ValidateConfig and,
// once a plan ends, plans are served again.
TEST_F(PlannerServiceTest, PlansBeyondTheConcurrencyLimitAreRefused) {
  StartServer({.admission = {.max_calls = 2, .max_bytes = int64_t{64} << 30}});
  const v1::PlanLayoutRequest slow = SlowRequest();
  BackgroundPlan first(stub_.get(), slow);
  BackgroundPlan second(stub_.get(), slow);
  WaitForPlansInFlight(2);

  v1::PlanLayoutResponse response;
  const grpc::Status refused = Plan(SmallRequest(), &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_THAT(refused.error_message(), HasSubstr("--max_concurrent_plans"));
  v1::ValidateConfigRequest validate;
  *validate.mutable_model() = SmallRequest().model();
  validate.set_world_size(4);
  v1::ValidateConfigResponse violations;
  EXPECT_TRUE(Validate(validate, &violations).ok());

  // A client that cancels frees its place.
  EXPECT_EQ(first.Cancel().error_code(), grpc::StatusCode::CANCELLED);
  WaitForPlansInFlight(1);
  ExpectServing();
  EXPECT_EQ(second.Cancel().error_code(), grpc::StatusCode::CANCELLED);
  WaitForPlansInFlight(0);
}

// Each call's memory estimate counts against the server's budget: a plan
// bigger than the whole budget is refused outright, one that would pass it
// with the plans in flight is refused until they end; small ones still fit.
TEST_F(PlannerServiceTest, PlansBeyondTheMemoryBudgetAreRefused) {
  const v1::PlanLayoutRequest slow = SlowRequest();
  const plan::PlanInput input = convert::PlanInputFromProto(slow);
  absl::StatusOr<plan::PlanSize> size = plan::EstimatePlanSize(input);
  ASSERT_TRUE(size.ok()) << size.status();
  const double bytes = coordinator::PlanCallBytes(*size, static_cast<double>(slow.ByteSizeLong()),
                                     coordinator::ResponseBytesBound(input, *size, false));

  StartServer({.admission = {.max_calls = 8, .max_bytes = static_cast<int64_t>(bytes / 2)}});
  v1::PlanLayoutResponse response;
  grpc::Status status = Plan(slow, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("more than the server allows"));

  StartServer({.admission = {.max_calls = 8, .max_bytes = static_cast<int64_t>(bytes * 1.5)}});
  BackgroundPlan first(stub_.get(), slow);
  WaitForPlansInFlight(1);
  status = Plan(slow, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("--plan_memory_mib"));
  ExpectServing();
  EXPECT_EQ(first.Cancel().error_code(), grpc::StatusCode::CANCELLED);
}

// Shutdown stops a plan at once: with a grace far longer than the plan, the
// plan would otherwise finish and answer OK.
TEST_F(PlannerServiceTest, ShutdownCancelsPlansInFlight) {
  const v1::PlanLayoutRequest slow = SlowRequest();
  BackgroundPlan plan(stub_.get(), slow);
  WaitForPlansInFlight(1);
  server_->Shutdown(absl::Seconds(300));
  server_->Wait();
  const grpc::Status& status = plan.Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("shutting down"));
  server_ = nullptr;
}

// Plans too big to build or to answer are refused from their counts, before
// planning, with the field or the limit named; ValidateConfig lists the
// planner's own size limit like any violation.
TEST_F(PlannerServiceTest, PlansTooBigAreRefusedBeforePlanning) {
  // 1000 (then 900) layers of one [2^20, 2^20] matrix on 16384 ranks: each
  // matrix is cut into 16384 row runs.
  auto huge = [](int units) {
    v1::PlanLayoutRequest r;
    r.set_world_size(16384);
    for (int u = 0; u < units; ++u) {
      v1::UnitSpec* unit = r.mutable_model()->add_units();
      unit->set_name(absl::StrCat("u", u));
      v1::ParamSpec* p = unit->add_params();
      p->set_name(absl::StrCat("u", u, ".w"));
      p->add_shape(int64_t{1} << 20);
      p->add_shape(int64_t{1} << 20);
      p->set_optimizer("muon");
    }
    return r;
  };
  v1::PlanLayoutResponse response;
  grpc::Status status = Plan(huge(1000), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(DetailFields(status), UnorderedElementsAre("world_size"));
  EXPECT_THAT(status.error_message(), HasSubstr("planning would take about"));
  // Within the planner's limit, but 900 x 16384 holders are ~340 MiB of answer.
  status = Plan(huge(900), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("server limit 256 MiB"));

  v1::ValidateConfigRequest validate;
  *validate.mutable_model() = huge(1000).model();
  validate.set_world_size(16384);
  v1::ValidateConfigResponse violations;
  ASSERT_TRUE(Validate(validate, &violations).ok());
  ASSERT_EQ(violations.violations_size(), 1);
  EXPECT_EQ(violations.violations(0).field(), "world_size");
  EXPECT_EQ(server_->planner().plans_in_flight(), 0);
  ExpectServing();
}

// A 10 MB unit name is refused, and never echoed whole.
TEST_F(PlannerServiceTest, HugeNamesAreRefusedWithoutEchoingThem) {
  v1::PlanLayoutRequest request = SmallRequest();
  request.mutable_model()->mutable_units(0)->set_name(std::string(10 << 20, 'u'));
  v1::PlanLayoutResponse response;
  const grpc::Status status = Plan(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(DetailFields(status), UnorderedElementsAre("model.units[0].name"));
  EXPECT_THAT(status.error_message(), HasSubstr("unit name of 10485760 bytes exceeds the limit"));
  EXPECT_LT(status.error_message().size(), 1024u);
  v1::ValidateConfigRequest validate;
  *validate.mutable_model() = request.model();
  validate.set_world_size(4);
  v1::ValidateConfigResponse violations;
  ASSERT_TRUE(Validate(validate, &violations).ok());
  ASSERT_EQ(violations.violations_size(), 1);
  EXPECT_LT(violations.violations(0).description().size(), 1024u);
}

// A one-rank mlp job to submit (with no worker, it stays PENDING).
v1::SubmitJobRequest OneRankJob() {
  v1::SubmitJobRequest submit;
  EXPECT_TRUE(protoio::ParseMessageText(
                  "name: j\nworld_size: 1\nmodel: {mlp: {dims: [6, 16, 3]}}\n"
                  "training: {steps: 2, global_batch_size: 4}\noutput: {dir: /tmp/j}\n",
                  "job", submit.mutable_spec())
                  .ok());
  return submit;
}

// A coordinator that cannot write its state takes no new work until it is
// restarted (JobManager::state_error), and says so to probes: the server
// and its control services turn NOT_SERVING; the Planner serves on.
TEST_F(PlannerServiceTest, AStateItCannotWriteTurnsItsControlServicesNotServing) {
#if MUONMESH_HAVE_HEALTH_PROTO
  const std::string dir = ::testing::TempDir() + "/planner_service_state_error";
  std::filesystem::remove_all(dir);
  coordinator::CoordinatorServerOptions options;
  options.listen = "127.0.0.1:0";
  options.control.data_dir = dir;
  absl::StatusOr<std::unique_ptr<coordinator::CoordinatorServer>> server = coordinator::CoordinatorServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = grpc::CreateChannel((*server)->address(), grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  auto status_of = [&](const std::string& service) {
    grpc::ClientContext context;
    Deadline(&context);
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    EXPECT_TRUE(health->Check(&context, request, &response).ok()) << service;
    return response.status();
  };
  using Health = grpc::health::v1::HealthCheckResponse;
  EXPECT_EQ(status_of("muonmesh.v1.Jobs"), Health::SERVING);
  ASSERT_TRUE((*server)->control()->job_store_for_test().SetReadOnlyForTest(true).ok());
  // A submit, which writes the job first, fails on the read-only state.
  auto jobs = v1::Jobs::NewStub(channel);
  const v1::SubmitJobRequest submit = OneRankJob();
  grpc::ClientContext context;
  Deadline(&context);
  v1::SubmitJobResponse answer;
  EXPECT_FALSE(jobs->SubmitJob(&context, submit, &answer).ok());
  // The lease thread reports it within a tick (200 ms).
  for (int i = 0; i < 100 && status_of("muonmesh.v1.Jobs") == Health::SERVING; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (const std::string service :
       {"", "muonmesh.v1.Jobs", "muonmesh.v1.Fleet", "muonmesh.v1.Store"}) {
    EXPECT_EQ(status_of(service), Health::NOT_SERVING) << service;
  }
  EXPECT_EQ(status_of("muonmesh.v1.Planner"), Health::SERVING);
  (*server)->Shutdown(absl::Seconds(1));
  (*server)->Wait();
#else
  GTEST_SKIP() << "built without the gRPC health proto";
#endif
}

// This process's threads (Linux: /proc/self/task).
int ThreadCount() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

// Streams held open and never read (abandoned watches) each hold a server
// thread; --max-rpc-threads bounds them: past it calls are refused with
// RESOURCE_EXHAUSTED instead of getting new threads, and once the streams
// go the server answers again.
TEST_F(PlannerServiceTest, AbandonedStreamsAreBoundedByTheThreadQuota) {
  const std::string dir = ::testing::TempDir() + "/planner_service_threads";
  std::filesystem::remove_all(dir);
  coordinator::CoordinatorServerOptions options;
  options.listen = "127.0.0.1:0";
  options.control.data_dir = dir;
  options.max_rpc_threads = 16;
  absl::StatusOr<std::unique_ptr<coordinator::CoordinatorServer>> server = coordinator::CoordinatorServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = grpc::CreateChannel((*server)->address(), grpc::InsecureChannelCredentials());
  auto jobs = v1::Jobs::NewStub(channel);
  const v1::SubmitJobRequest submit = OneRankJob();
  v1::SubmitJobResponse submitted;  // no worker: it stays PENDING, its watch open
  {
    grpc::ClientContext context;
    Deadline(&context);
    ASSERT_TRUE(jobs->SubmitJob(&context, submit, &submitted).ok());
  }
  const int before = ThreadCount();
  constexpr int kStreams = 48;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReader<v1::JobEvent>>> streams;
  v1::WatchJobRequest watch;
  watch.set_job_id(submitted.job().id());
  watch.set_from_index(1000);  // past its events: the stream waits
  for (int i = 0; i < kStreams; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    streams.push_back(jobs->WatchJob(contexts.back().get(), watch));
  }
  // Let the server take them up, then ask for the job: answered, or
  // refused for the quota, never hung.
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const int held = ThreadCount() - before;
  v1::GetJobRequest get;
  get.set_job_id(submitted.job().id());
  v1::Job job;
  grpc::ClientContext context;
  Deadline(&context);
  const grpc::Status got = jobs->GetJob(&context, get, &job);
  EXPECT_TRUE(got.ok() || got.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED)
      << got.error_code() << " " << got.error_message();
  // Not a thread a stream: the quota's 16 and the server's own few.
  EXPECT_LT(held, kStreams / 2) << "server threads grew by " << held << " for " << kStreams
                                << " streams";
  // The call past the quota was refused (or answered, had a stream ended
  // meanwhile); the streams go, and then calls are answered again.
  EXPECT_TRUE(got.ok() || got.error_message().find("xhausted") != std::string::npos)
      << got.error_message();
  for (int i = 0; i < kStreams; ++i) {
    contexts[i]->TryCancel();
    (void)streams[i]->Finish();
  }
  grpc::Status last;
  for (int i = 0; i < 100; ++i) {
    grpc::ClientContext after;
    Deadline(&after);
    last = jobs->GetJob(&after, get, &job);
    if (last.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(last.ok()) << last.error_code() << " " << last.error_message();
  (*server)->Shutdown(absl::Seconds(1));
  (*server)->Wait();
}

TEST_F(PlannerServiceTest, SecondServerCannotTakeABoundPort) {
  coordinator::CoordinatorServerOptions options;
  options.listen = server_->address();
  const absl::StatusOr<std::unique_ptr<coordinator::CoordinatorServer>> second =
      coordinator::CoordinatorServer::Start(options);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  ExpectServing();
}

}  // namespace
}  // namespace muonmesh::coordinator
