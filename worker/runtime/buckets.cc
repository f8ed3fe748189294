// The trainer's communication buckets (core/plan/buckets.h): gradient
// reductions and the after-step parameter gathers of consecutive units as
// one collective per bucket. docs/architecture.md §5, "Buckets".

#include "worker/runtime/trainer_impl.h"

namespace muonmesh::worker {

void Trainer::Impl::PlanBuckets() {
  buckets.clear();
  for (const plan::Bucket& b : plan::PlanBuckets(*plan, options.bucket_bytes)) {
    BucketState& out = buckets.emplace_back();
    MeshState& mesh = b.mesh == plan::MeshKind::kDense ? dense : expert;
    out.mesh = &mesh;
    for (int32_t unit : b.units) {
      for (int32_t state : states_of[unit]) {
        if (units[state].mesh == &mesh) out.states.push_back(state);
      }
    }
    // Each unit's part at every reduce level: level l + 1 is my chunk of
    // level l (its size divided by that level's group).
    const size_t levels = mesh.reduce_scatter_comms.size();
    out.size.assign(levels + 1, {});
    out.prefix.assign(levels + 1, {});
    out.total.assign(levels + 1, 0);
    for (size_t l = 0; l <= levels; ++l) {
      for (int32_t state : out.states) {
        const int64_t n = l == 0 ? plan::PaddedElements(*units[state].layout)
                                 : out.size[l - 1][out.size[l].size()] /
                                       mesh.reduce_scatter_comms[l - 1]->size();
        out.prefix[l].push_back(out.total[l]);
        out.size[l].push_back(n);
        out.total[l] += n;
      }
    }
    for (int32_t state : out.states) {
      out.shard_prefix.push_back(out.shard_total);
      out.shard_total += units[state].layout->shard_elements;
    }
  }
  after_step_order.resize(buckets.size());
  for (size_t b = 0; b < buckets.size(); ++b) after_step_order[b] = static_cast<int32_t>(b);
  std::stable_sort(after_step_order.begin(), after_step_order.end(), [&](int32_t a, int32_t b) {
    return units[buckets[a].states[0]].unit < units[buckets[b].states[0]].unit;
  });
  after_step_ticket.assign(buckets.size(), 0);
  bucket_of.assign(units.size(), {-1, -1});
  for (size_t b = 0; b < buckets.size(); ++b) {
    for (size_t i = 0; i < buckets[b].states.size(); ++i) {
      bucket_of[buckets[b].states[i]] = {static_cast<int32_t>(b), static_cast<int32_t>(i)};
    }
  }
}

int64_t Trainer::Impl::CollectiveCalls() const {
  int64_t calls = 0;
  auto add = [&](const comm::Communicator* c) {
    if (c == nullptr) return;
    for (const comm::CollectiveCounters& k : c->stats().by_collective) calls += k.calls;
  };
  add(world_comm.get());
  add(ep_comm.get());
  for (const MeshState* mesh : {&dense, &expert}) {
    add(mesh->domain_comm.get());
    add(mesh->gather_comm.get());
    for (const auto& c : mesh->reduce_scatter_comms) add(c.get());
    for (const auto& c : mesh->all_reduce_comms) add(c.get());
  }
  // The parameter groups (group_comm) make only the after-step gathers.
  return calls + after_step_calls;
}

bool Trainer::Impl::ReducesNothing(const MeshState& mesh) {
  for (const auto& c : mesh.reduce_scatter_comms) {
    if (c->size() > 1) return false;
  }
  return mesh.all_reduce_comms.empty();
}

absl::Status Trainer::Impl::PackGradients(int32_t state, float* buf, const float* const* src,
                                          bool alone) {
  UnitState& u = units[state];
  const auto [b, i] = bucket_of[state];
  const BucketState& bucket = buckets[b];
  const plan::UnitLayout& l = *u.layout;
  const int64_t s = l.shard_elements;
  // The first reduce level's chunks (one chunk when the mesh has none):
  // chunk j of this unit sits at j * (the bucket's chunk) + its prefix.
  // Alone, `buf` is the unit's own padded buffer.
  const bool leveled = bucket.size.size() > 1 && !alone;
  const int64_t chunk = leveled ? bucket.size[1][i] : bucket.size[0][i];
  const int64_t stride = leveled ? bucket.total[1] : alone ? 0 : bucket.total[0];
  const int64_t prefix = leveled ? bucket.prefix[1][i] : alone ? 0 : bucket.prefix[0][i];
  const int64_t chunks = bucket.size[0][i] / chunk;
  for (int64_t j = 0; j < chunks; ++j) {
    MUONMESH_RETURN_IF_ERROR(dev->Fill(buf + j * stride + prefix, chunk, 0.0f));
  }
  return ForEachSegment(l, [&](int64_t q, const plan::Segment& seg, int64_t len) {
    // A chunk is whole shards, so a segment never straddles two.
    const int64_t x = q * s + seg.offset;
    return dev->Copy(buf + (x / chunk) * stride + prefix + x % chunk,
                     src[u.local[seg.tensor]] + seg.row_start * len, seg.row_count * len);
  });
}

absl::Status Trainer::Impl::ReduceBucket(int32_t b, float* buf, StepReport* report) {
  const BucketState& bucket = buckets[b];
  MeshState& mesh = *bucket.mesh;
  const size_t levels = mesh.reduce_scatter_comms.size();
  // Reduce-scatters in place (each level's output is my chunk of its
  // input); between levels my chunk is regrouped so that the next level's
  // chunks are again whole runs of every unit.
  float* cur = buf;
  DeviceBuffer regroup;
  for (size_t l = 0; l < levels; ++l) {
    comm::Communicator& c = *mesh.reduce_scatter_comms[l];
    const int64_t out = bucket.total[l + 1];
    float* const mine = cur + c.rank() * out;
    absl::Status st = Counted(c, mesh.bytes_prefix + "grad_reduce_scatter", report, [&] {
      return c.ReduceScatter(cur, mine, out, comm::ReduceOp::kAvg, options.collective);
    });
    MUONMESH_RETURN_IF_ERROR(st);
    cur = mine;
    const int64_t n = l + 1 < levels ? mesh.reduce_scatter_comms[l + 1]->size() : 1;
    if (n == 1 || bucket.states.size() == 1) continue;
    // Unit i's run (size[l+1][i]) holds the next level's n chunks of
    // size[l+2][i]: chunk j goes to j * total[l+2] + prefix[l+2][i].
    if (regroup.empty()) {
      MUONMESH_ASSIGN_OR_RETURN(regroup, unit_buffers.Take(bucket.total[1]));
    }
    for (size_t i = 0; i < bucket.states.size(); ++i) {
      const int64_t piece = bucket.size[l + 2][i];
      for (int64_t j = 0; j < n; ++j) {
        MUONMESH_RETURN_IF_ERROR(
            dev->Copy(regroup.data() + j * bucket.total[l + 2] + bucket.prefix[l + 2][i],
                      cur + bucket.prefix[l + 1][i] + j * piece, piece));
      }
    }
    MUONMESH_RETURN_IF_ERROR(dev->Copy(cur, regroup.data(), out));
  }
  if (!regroup.empty()) unit_buffers.Give(std::move(regroup));
  const int64_t m = bucket.total[levels];
  for (auto& c : mesh.all_reduce_comms) {
    absl::Status st = Counted(*c, mesh.bytes_prefix + "grad_allreduce", report, [&] {
      return c->AllReduce(cur, m, comm::ReduceOp::kAvg, options.collective);
    });
    MUONMESH_RETURN_IF_ERROR(st);
  }
  // Micro-batches after the first add to the first's (gradient accumulation).
  for (size_t i = 0; i < bucket.states.size(); ++i) {
    UnitState& u = units[bucket.states[i]];
    const float* from = cur + bucket.prefix[levels][i];
    const int64_t s = u.layout->shard_elements;
    MUONMESH_RETURN_IF_ERROR(accumulating ? dev->Add(u.grad.data(), from, s)
                                          : dev->Copy(u.grad.data(), from, s));
  }
  return absl::OkStatus();
}

absl::Status Trainer::Impl::GatherAfterStep(StepReport* report) {
  for (int32_t b : after_step_order) {
    if (buckets[b].mesh->k == 1) continue;
    ++after_step_calls;
    MUONMESH_RETURN_IF_ERROR(GatherBucketAfterStep(b, report));
  }
  return absl::OkStatus();
}

absl::Status Trainer::Impl::GatherBucketAfterStep(int32_t b, StepReport* report) {
  BucketState& bucket = buckets[b];
  MeshState& mesh = *bucket.mesh;
  comm::Communicator& c = *mesh.group_comm;
  const std::string name = mesh.bytes_prefix + "param_allgather_after_step";
  const int64_t pos = mesh.position % mesh.k;
  if (bucket.states.size() == 1) {
    UnitState& u = units[bucket.states[0]];
    const int64_t s = u.layout->shard_elements;
    return Counted(c, name, report, [&] {
      return c.AllGather(u.param.data() + pos * s, s, u.param.data(), options.collective);
    });
  }
  // Mine of every unit side by side, gathered in place, then each rank's
  // run handed back to its units.
  const int64_t total = bucket.shard_total;
  MUONMESH_ASSIGN_OR_RETURN(DeviceBuffer buf, unit_buffers.Take(mesh.k * total));
  absl::Status st;
  for (size_t i = 0; i < bucket.states.size() && st.ok(); ++i) {
    UnitState& u = units[bucket.states[i]];
    const int64_t s = u.layout->shard_elements;
    st = dev->Copy(buf.data() + pos * total + bucket.shard_prefix[i], u.param.data() + pos * s, s);
  }
  if (st.ok()) {
    st = Counted(c, name, report, [&] {
      return c.AllGather(buf.data() + pos * total, total, buf.data(), options.collective);
    });
  }
  for (int64_t q = 0; q < mesh.k && st.ok(); ++q) {
    if (q == pos) continue;
    for (size_t i = 0; i < bucket.states.size() && st.ok(); ++i) {
      UnitState& u = units[bucket.states[i]];
      const int64_t s = u.layout->shard_elements;
      st = dev->Copy(u.param.data() + q * s, buf.data() + q * total + bucket.shard_prefix[i], s);
    }
  }
  unit_buffers.Give(std::move(buf));
  return st;
}

void Trainer::Impl::StartGatherAfterStep(StepReport* report) {
  for (int32_t b : after_step_order) {
    const BucketState& bucket = buckets[b];
    const MeshState& mesh = *bucket.mesh;
    if (mesh.k == 1) continue;
    if (after_step == nullptr) {  // at the first gather: none for a plan without them
      // Room for every bucket's gather: the step never waits to push.
      after_step = std::make_unique<CommThread>(buckets.size(),
                                                &PhaseTimes::param_allgather_after_step,
                                                &PhaseTimes::param_gather_hidden);
    }
    // What the gather will send, by the communicator's byte model
    // (comm/communicator.h): this step's, as when the step waited for it.
    const int64_t count = bucket.states.size() == 1
                              ? units[bucket.states[0]].layout->shard_elements
                              : bucket.shard_total;
    report->bytes_sent[mesh.bytes_prefix + "param_allgather_after_step"] +=
        (mesh.group_comm->size() - 1) * count * 4;
    ++after_step_calls;
    after_step_ticket[b] = after_step->Push([this, b](StepReport*, bool failed) {
      return failed ? absl::OkStatus() : GatherBucketAfterStep(b, nullptr);
    });
  }
}

absl::Status Trainer::Impl::AwaitGatherAfterStep(int32_t state, StepReport* report) {
  const int32_t b = bucket_of[state].first;
  if (after_step == nullptr || b < 0 || after_step_ticket[b] == 0) return absl::OkStatus();
  return after_step->Await(after_step_ticket[b], report);
}

absl::Status Trainer::Impl::DrainGatherAfterStep(StepReport* report) {
  if (after_step == nullptr) return absl::OkStatus();
  after_step_ticket.assign(buckets.size(), 0);
  absl::Status st = after_step->Drain(report);
  // Kept: the parameters it left stale stay stale.
  if (!st.ok() && after_step_failed.ok()) {
    after_step_failed = absl::Status(
        st.code(), absl::StrCat("the parameters' gather after the last step failed: ",
                                st.message()));
  }
  return after_step_failed;
}

absl::Status Trainer::Impl::GatherStates(absl::Span<const int32_t> states,
                                         absl::Span<float* const* const> dst,
                                         StepReport* report, const char* name) {
  if (states.size() == 1) return GatherUnit(units[states[0]], report, dst[0], name);
  MeshState& mesh = *units[states[0]].mesh;
  comm::Communicator& c = *mesh.gather_comm;
  // Each unit's parameter group (k shards) side by side: rank g of the
  // gather group holds positions [g k, (g + 1) k) of every unit.
  std::vector<int64_t> prefix;
  int64_t total = 0;
  for (int32_t state : states) {
    prefix.push_back(total);
    total += mesh.k * units[state].layout->shard_elements;
  }
  MUONMESH_ASSIGN_OR_RETURN(DeviceBuffer buf, unit_buffers.Take(c.size() * total));
  absl::Status st;
  for (size_t i = 0; i < states.size() && st.ok(); ++i) {
    const UnitState& u = units[states[i]];
    st = dev->Copy(buf.data() + c.rank() * total + prefix[i], u.param.data(), u.param.size());
  }
  if (st.ok()) {
    st = Counted(c, mesh.bytes_prefix + name, report, [&] {
      return c.AllGather(buf.data() + c.rank() * total, total, buf.data(), options.collective);
    });
  }
  for (size_t i = 0; i < states.size() && st.ok(); ++i) {
    const UnitState& u = units[states[i]];
    const int64_t s = u.layout->shard_elements;
    st = ForEachSegment(*u.layout, [&](int64_t q, const plan::Segment& seg, int64_t len) {
      const float* from = buf.data() + (q / mesh.k) * total + prefix[i] + (q % mesh.k) * s;
      return dev->Copy(dst[i][u.local[seg.tensor]] + seg.row_start * len, from + seg.offset,
                       seg.row_count * len);
    });
  }
  unit_buffers.Give(std::move(buf));
  return st;
}

}  // namespace muonmesh::worker
