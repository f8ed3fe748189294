#include "client/job_commands.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <deque>
#include <map>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/json_writer.h"

namespace muonmesh::client {
namespace {

std::string StateName(v1::JobState s) {
  return v1::JobState_Name(s).substr(std::string("JOB_STATE_").size());
}

// Every --json output in one dialect (client/json_writer.h): every field,
// numbers as numbers, states as the tables name them.
std::string Json(const google::protobuf::Message& m) {
  JsonOptions options;
  options.short_enum_names = true;
  return ToJson(m, options);
}

int Fail(const absl::Status& s, Streams io) {
  io.err << "muonmeshctl: " << s.message() << "\n";
  return ExitCode(s);
}

std::string Time(int64_t unix_ms) {
  if (unix_ms == 0) return "-";
  return absl::FormatTime("%Y-%m-%d %H:%M:%S", absl::FromUnixMillis(unix_ms),
                          absl::LocalTimeZone());
}

std::string Duration(double seconds) {
  if (!(seconds > 0)) return "-";
  const int64_t s = static_cast<int64_t>(std::llround(seconds));
  return absl::StrFormat("%d:%02d:%02d", s / 3600, (s / 60) % 60, s % 60);
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

const std::vector<std::pair<const char*, double (v1::PhaseSeconds::*)() const>>& Phases() {
  static const auto* phases =
      new std::vector<std::pair<const char*, double (v1::PhaseSeconds::*)() const>>{
          {"param_gather", &v1::PhaseSeconds::param_gather},
          {"forward_backward", &v1::PhaseSeconds::forward_backward},
          {"expert_dispatch", &v1::PhaseSeconds::expert_dispatch},
          {"grad_reduce", &v1::PhaseSeconds::grad_reduce},
          {"adamw", &v1::PhaseSeconds::adamw},
          {"muon_prepare", &v1::PhaseSeconds::muon_prepare},
          {"muon_gather", &v1::PhaseSeconds::muon_gather},
          {"newton_schulz", &v1::PhaseSeconds::newton_schulz},
          {"muon_scatter", &v1::PhaseSeconds::muon_scatter},
          {"muon_apply", &v1::PhaseSeconds::muon_apply},
          {"param_allgather_after_step", &v1::PhaseSeconds::param_allgather_after_step},
          {"grad_reduce_hidden", &v1::PhaseSeconds::grad_reduce_hidden},
          {"param_gather_hidden", &v1::PhaseSeconds::param_gather_hidden},
          {"muon_gather_hidden", &v1::PhaseSeconds::muon_gather_hidden}};
  return *phases;
}

}  // namespace

int ExitCode(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return kExitOk;
    case absl::StatusCode::kInvalidArgument:
      return kExitInvalid;
    case absl::StatusCode::kUnavailable:
      return kExitUnreachable;
    case absl::StatusCode::kDeadlineExceeded:
      return kExitDeadline;
    default:
      return kExitRefused;
  }
}

int Submit(CoordinatorClient& client, const std::string& file, const std::string& request_id,
           Streams io) {
  absl::StatusOr<v1::JobSpec> spec = LoadJobForSubmit(file);
  if (!spec.ok()) {
    io.err << "muonmeshctl: " << spec.status().message() << "\n";
    return kExitUsage;
  }
  absl::StatusOr<v1::SubmitJobResponse> r = client.Submit(*spec, request_id);
  if (!r.ok()) return Fail(r.status(), io);
  io.err << (r->created() ? "submitted " : "already submitted (same request id) ")
         << r->job().name() << ": " << StateName(r->job().state()) << ", "
         << r->job().reason() << "\n";
  io.out << r->job().id() << "\n";
  return kExitOk;
}

int Resume(CoordinatorClient& client, const std::string& job_id, int64_t world_size,
           const std::string& request_id, Streams io) {
  absl::StatusOr<v1::Job> earlier = client.Get(job_id);
  if (!earlier.ok()) return Fail(earlier.status(), io);
  absl::StatusOr<v1::JobSpec> spec = ResumeSpecOf(earlier->spec(), world_size);
  if (!spec.ok()) return Fail(spec.status(), io);
  absl::StatusOr<v1::SubmitJobResponse> r = client.Submit(*spec, request_id);
  if (!r.ok()) return Fail(r.status(), io);
  io.err << (r->created() ? "submitted " : "already submitted (same request id) ")
         << r->job().name() << " as the resume of " << job_id << " from "
         << spec->init().checkpoint() << " at " << spec->world_size() << " ranks: "
         << StateName(r->job().state()) << ", " << r->job().reason() << "\n";
  io.out << r->job().id() << "\n";
  return kExitOk;
}

namespace {

// `status` without a job: how many jobs are in each state and how many
// workers of each device kind are in each state.
int Overview(CoordinatorClient& client, bool json, Streams io) {
  absl::StatusOr<std::vector<v1::Job>> jobs = client.List({}, "");
  if (!jobs.ok()) return Fail(jobs.status(), io);
  absl::StatusOr<std::vector<v1::Worker>> workers = client.Workers();
  if (!workers.ok()) return Fail(workers.status(), io);
  std::map<std::string, int64_t> job_states;
  for (const v1::Job& j : *jobs) ++job_states[StateName(j.state())];
  std::map<std::string, std::map<std::string, int64_t>> worker_states;  // device -> state -> n
  for (const v1::Worker& w : *workers) {
    ++worker_states[w.info().device()]
                   [v1::WorkerState_Name(w.state()).substr(std::string("WORKER_STATE_").size())];
  }
  auto counts = [](const std::map<std::string, int64_t>& m, const char* sep, const char* quote) {
    std::vector<std::string> parts;
    for (const auto& [k, n] : m) parts.push_back(absl::StrCat(quote, k, quote, sep, n));
    return parts;
  };
  if (json) {
    std::vector<std::string> devices;
    for (const auto& [device, states] : worker_states) {
      devices.push_back(
          absl::StrCat("\"", device, "\":{", absl::StrJoin(counts(states, ":", "\""), ","), "}"));
    }
    io.out << "{\"coordinator\":\"" << client.address() << "\",\"jobs\":{"
           << absl::StrJoin(counts(job_states, ":", "\""), ",") << "},\"workers\":{"
           << absl::StrJoin(devices, ",") << "}}\n";
    return kExitOk;
  }
  io.out << "coordinator  " << client.address() << "\n";
  io.out << "jobs         " << jobs->size();
  if (!job_states.empty()) io.out << " (" << absl::StrJoin(counts(job_states, " ", ""), ", ") << ")";
  io.out << "\n";
  io.out << "workers      " << workers->size() << "\n";
  for (const auto& [device, states] : worker_states) {
    io.out << "  " << absl::StrFormat("%-10s ", device)
           << absl::StrJoin(counts(states, " ", ""), ", ") << "\n";
  }
  return kExitOk;
}

}  // namespace

int Status(CoordinatorClient& client, const std::string& job_id, bool json, Streams io) {
  if (job_id.empty()) return Overview(client, json, io);
  absl::StatusOr<v1::Job> job = client.Get(job_id);
  if (!job.ok()) return Fail(job.status(), io);
  if (json) {
    io.out << Json(*job) << "\n";
    return kExitOk;
  }
  io.out << absl::StrFormat(
      "job        %s (%s)\nstate      %s: %s\nsteps      %d of %d\nloss       %s\n"
      "val loss   %s\nstep time  %s\nETA        %s\nattempt    %d\nworkers    %s\n"
      "submitted  %s\nstarted    %s\nfinished   %s\n",
      job->id(), job->name(), StateName(job->state()), job->reason(), job->steps_done(),
      job->steps_total(),
      std::isfinite(job->last_loss()) ? absl::StrFormat("%.6e", job->last_loss()) : "-",
      job->has_last_val_loss()
          ? absl::StrFormat("%.6e (after step %d)", job->last_val_loss(), job->last_val_step())
          : "-",
      job->step_seconds() > 0 ? absl::StrFormat("%.3f s", job->step_seconds()) : "-",
      Duration(job->eta_seconds()), job->attempt(),
      job->worker_ids().empty() ? "-" : absl::StrJoin(job->worker_ids(), ", "),
      Time(job->submitted_unix_ms()), Time(job->started_unix_ms()),
      Time(job->finished_unix_ms()));
  return kExitOk;
}

int List(CoordinatorClient& client, const std::string& states, const std::string& name,
         bool json, Streams io) {
  std::vector<v1::JobState> filter;
  for (absl::string_view s : absl::StrSplit(states, ',', absl::SkipEmpty())) {
    v1::JobState state;
    if (!v1::JobState_Parse(absl::StrCat("JOB_STATE_", absl::AsciiStrToUpper(s)), &state)) {
      io.err << "muonmeshctl: --state: unknown state '" << s
             << "' (pending, running, restarting, succeeded, failed, cancelled)\n";
      return kExitUsage;
    }
    filter.push_back(state);
  }
  absl::StatusOr<std::vector<v1::Job>> jobs = client.List(filter, name);
  if (!jobs.ok()) return Fail(jobs.status(), io);
  if (json) {
    v1::ListJobsResponse all;
    for (const v1::Job& j : *jobs) *all.add_jobs() = j;
    io.out << Json(all) << "\n";
    return kExitOk;
  }
  io.out << absl::StrFormat("%-10s %-24s %-11s %13s %12s  %s\n", "JOB", "NAME", "STATE", "STEPS",
                            "LOSS", "SUBMITTED");
  for (const v1::Job& j : *jobs) {
    io.out << absl::StrFormat(
        "%-10s %-24s %-11s %13s %12s  %s\n", j.id(), j.name().substr(0, 24),
        StateName(j.state()), absl::StrCat(j.steps_done(), "/", j.steps_total()),
        std::isfinite(j.last_loss()) ? absl::StrFormat("%.4e", j.last_loss()) : "-",
        Time(j.submitted_unix_ms()));
  }
  return kExitOk;
}

namespace {
std::atomic<int64_t> watch_next_index{1};
}  // namespace

int64_t WatchNextIndex() { return watch_next_index.load(); }

std::string WatchResumeHint(const std::string& job_id, int64_t next_index) {
  return absl::StrCat("muonmeshctl watch ", job_id, " --from ", next_index);
}

std::string HealthWarning(const v1::StepRecord& r) {
  const v1::MuonHealth& h = r.muon();
  if (h.planned_elements() > 0 && h.elements() < h.planned_elements()) {
    return absl::StrFormat("step %d  warning: Muon updated %d of the %d elements planned", r.step(),
                           h.elements(), h.planned_elements());
  }
  if (h.has_ortho_error_max() && h.ortho_error_max() > 1.0) {
    return absl::StrFormat("step %d  warning: orthogonality error %.3f (above 1)", r.step(),
                           h.ortho_error_max());
  }
  return "";
}

namespace {
// ToJson's output on one line (JSON Lines): its line breaks and indentation
// lie between tokens (a string holds a newline escaped), so they go, and a
// space stays only between two tokens on the same level.
std::string OneLine(const std::string& json) {
  std::string out;
  out.reserve(json.size());
  for (size_t i = 0; i < json.size(); ++i) {
    if (json[i] != '\n') {
      out += json[i];
      continue;
    }
    while (i + 1 < json.size() && json[i + 1] == ' ') ++i;
    const char next = i + 1 < json.size() ? json[i + 1] : '}';
    if (!out.empty() && out.back() != '{' && out.back() != '[' && next != '}' && next != ']') {
      out += ' ';
    }
  }
  return out;
}
}  // namespace

int Watch(CoordinatorClient& client, const std::string& job_id, int64_t from_index,
          absl::Duration timeout, bool json, Streams io) {
  watch_next_index = std::max<int64_t>(from_index, 1);
  absl::StatusOr<v1::Job> job = client.Get(job_id);
  if (!job.ok()) return Fail(job.status(), io);
  const int64_t total = job->steps_total();
  v1::JobState last = v1::JOB_STATE_UNSPECIFIED;
  bool bar_open = false;
  auto end_bar = [&] {
    if (bar_open) io.out << "\n";
    bar_open = false;
  };
  // The ETA takes the median of the last steps (as the coordinator's job
  // status does), so one slow step does not swing it.
  constexpr std::size_t kRecent = 16;
  std::deque<double> recent;
  absl::Status st = client.Watch(job_id, from_index, timeout, [&](const v1::JobEvent& e) {
    watch_next_index = e.index() + 1;
    if (e.has_state_change()) last = e.state_change().state();
    if (json) {
      io.out << OneLine(Json(e)) << std::endl;
      return true;
    }
    if (e.has_state_change()) {
      end_bar();
      io.out << "[" << e.index() << "] " << StateName(last) << ": " << e.state_change().reason()
             << "\n";
    } else if (e.has_step()) {
      const v1::StepRecord& r = e.step();
      recent.push_back(r.step_seconds());
      if (recent.size() > kRecent) recent.pop_front();
      std::vector<double> sorted(recent.begin(), recent.end());
      std::nth_element(sorted.begin(), sorted.begin() + sorted.size() / 2, sorted.end());
      const double eta = sorted[sorted.size() / 2] * static_cast<double>(total - r.step() - 1);
      if (const std::string warning = HealthWarning(r); !warning.empty()) {
        end_bar();
        io.out << "[" << e.index() << "] " << warning << "\n";
      }
      if (io.terminal) {
        constexpr int kWidth = 30;
        const int filled =
            total > 0 ? static_cast<int>(kWidth * (r.step() + 1) / std::max<int64_t>(total, 1)) : 0;
        io.out << "\r[" << std::string(filled, '#') << std::string(kWidth - filled, '.') << "] "
               << absl::StrFormat("step %d/%d  loss %.4e  %.3f s/step  ETA %s   ", r.step() + 1,
                                  total, r.loss(), r.step_seconds(), Duration(eta))
               << std::flush;
        if (r.has_val_loss()) {
          // Kept on a line of its own: the bar overwrites itself.
          io.out << absl::StrFormat("\nstep %d  val_loss %.6e\n", r.step(), r.val_loss());
        }
        bar_open = true;
      } else {
        io.out << absl::StrFormat("[%d] step %d  loss %.6e  %.3f s  ETA %s\n", e.index(),
                                  r.step(), r.loss(), r.step_seconds(), Duration(eta));
        if (r.has_val_loss()) {
          io.out << absl::StrFormat("[%d] step %d  val_loss %.6e\n", e.index(), r.step(),
                                    r.val_loss());
        }
      }
    }
    // Each line as it happens, also into a pipe or a file.
    io.out << std::flush;
    return true;
  });
  end_bar();
  if (st.code() == absl::StatusCode::kDeadlineExceeded) {
    io.err << "muonmeshctl: watch: --timeout " << absl::FormatDuration(timeout)
           << " passed before job " << job_id << " ended; go on with: "
           << WatchResumeHint(job_id, watch_next_index.load()) << "\n";
    return ExitCode(st);
  }
  if (!st.ok()) return Fail(st, io);
  if (last == v1::JOB_STATE_FAILED || last == v1::JOB_STATE_CANCELLED) return kExitJobFailed;
  return kExitOk;
}

// The step's largest attention logit over its layers in `format`, or
// `none` for a model without attention.
std::string MaxLogit(const v1::StepRecord& r, const absl::FormatSpec<double>& format,
                     const char* none) {
  if (r.max_attn_logit().empty()) return none;
  float top = r.max_attn_logit(0);
  for (float v : r.max_attn_logit()) top = std::max(top, v);
  return absl::StrFormat(format, top);
}

// The step's most loaded expert over its MoE layers (tokens over the mean)
// in `format`, or `none` for a model without experts.
std::string MaxExpertLoad(const v1::StepRecord& r, const absl::FormatSpec<double>& format,
                          const char* none) {
  if (r.expert_load().empty()) return none;
  double top = 0;
  for (const v1::ExpertLoad& e : r.expert_load()) top = std::max(top, e.max_over_mean());
  return absl::StrFormat(format, top);
}

// `metrics --format csv`: a header, then a line per record.
void WriteMetricsCsv(const std::vector<v1::StepRecord>& records, Streams io) {
  io.out << "step,rank,attempt,loss,step_seconds";
  for (const auto& [name, get] : Phases()) io.out << "," << name;
  // val_loss last (empty on steps that were not evaluated), so that the
  // columns before it stay where scripts found them.
  io.out << ",bytes_sent,ns_flops,val_loss,grad_norm,lr_scale,max_attn_logit,muon_elements,"
            "muon_planned_elements,muon_update_rms,muon_ortho_error_max,expert_load_max\n";
  for (const v1::StepRecord& r : records) {
    int64_t bytes = 0;
    for (const auto& [name, b] : r.bytes_sent()) bytes += b;
    // The loss exactly (%.17g reads back to the same double), so that a
    // value rounded from it agrees with what watch and table print.
    io.out << absl::StrFormat("%d,%d,%d,%.17g,%.6f", r.step(), r.rank(), r.attempt(), r.loss(),
                              r.step_seconds());
    for (const auto& [name, get] : Phases()) {
      io.out << absl::StrFormat(",%.6f", (r.phases().*get)());
    }
    io.out << absl::StrFormat(",%d,%.6g,%s,%.9g,%.9g,%s,%d,%d,%.9g,%s,%s\n", bytes, r.ns_flops(),
                              r.has_val_loss() ? absl::StrFormat("%.17g", r.val_loss()) : "",
                              r.grad_norm(), r.lr_scale(), MaxLogit(r, "%.9g", ""),
                              r.muon().elements(), r.muon().planned_elements(),
                              r.muon().update_rms(),
                              r.muon().has_ortho_error_max()
                                  ? absl::StrFormat("%.9g", r.muon().ortho_error_max())
                                  : "",
                              MaxExpertLoad(r, "%.9g", ""));
  }
}

int Metrics(CoordinatorClient& client, const std::string& job_id, const std::string& format,
            bool summary, bool all_ranks, Streams io) {
  if (format != "table" && format != "json" && format != "csv") {
    io.err << "muonmeshctl: --format: '" << format << "' is not table, json or csv\n";
    return kExitUsage;
  }
  absl::StatusOr<std::vector<v1::StepRecord>> records = client.Metrics(job_id, 0, -1, all_ranks);
  if (!records.ok()) return Fail(records.status(), io);
  if (format == "json") {
    v1::GetJobMetricsResponse all;
    for (const v1::StepRecord& r : *records) *all.add_records() = r;
    io.out << Json(all) << "\n";
    return kExitOk;
  }
  if (format == "csv") {
    WriteMetricsCsv(*records, io);
    return kExitOk;
  }
  io.out << absl::StrFormat("%6s %4s %13s %13s %10s %6s %9s %9s %9s %9s %9s %12s %9s %9s\n",
                            "STEP", "RANK", "LOSS", "VAL LOSS", "GRAD NORM", "LR x", "STEP ms",
                            "GATHER", "FWD/BWD", "REDUCE", "MUON", "SENT B", "MAX LOGIT",
                            "MUON RMS");
  for (const v1::StepRecord& r : *records) {
    const v1::PhaseSeconds& p = r.phases();
    const double muon = p.muon_prepare() + p.muon_gather() + p.newton_schulz() +
                        p.muon_scatter() + p.muon_apply();
    int64_t bytes = 0;
    for (const auto& [name, b] : r.bytes_sent()) bytes += b;
    io.out << absl::StrFormat(
        "%6d %4d %13.6e %13s %10.3e %6.3f %9.2f %9.2f %9.2f %9.2f %9.2f %12d %9s %9.3e\n",
        r.step(), r.rank(), r.loss(),
        r.has_val_loss() ? absl::StrFormat("%.6e", r.val_loss()) : "-",
        r.grad_norm(), r.lr_scale(), 1e3 * r.step_seconds(),
        1e3 * p.param_gather(), 1e3 * p.forward_backward(),
        1e3 * p.grad_reduce(), 1e3 * muon, bytes, MaxLogit(r, "%.3f", "-"), r.muon().update_rms());
  }
  if (!summary || records->empty()) return kExitOk;
  std::vector<double> step;
  std::map<std::string, std::vector<double>> phase;
  std::map<std::string, int64_t> bytes;
  double flops = 0;
  double seconds = 0;
  for (const v1::StepRecord& r : *records) {
    step.push_back(r.step_seconds());
    for (const auto& [name, get] : Phases()) phase[name].push_back((r.phases().*get)());
    for (const auto& [name, b] : r.bytes_sent()) bytes[name] += b;
    flops += r.ns_flops();
    seconds += r.phases().newton_schulz();
  }
  io.out << absl::StrFormat("\n%d records; median step %.2f ms; first loss %.6e, last %.6e\n",
                            records->size(), 1e3 * Median(step), records->front().loss(),
                            records->back().loss());
  io.out << "median ms per phase:";
  for (const auto& [name, get] : Phases()) {
    io.out << absl::StrFormat(" %s %.2f", name, 1e3 * Median(phase[name]));
  }
  io.out << "\nbytes sent per collective:";
  for (const auto& [name, b] : bytes) io.out << " " << name << " " << b;
  io.out << absl::StrFormat("\nNewton-Schulz: %.3g FLOP in %.3f s (%.2f GFLOP/s)\n", flops,
                            seconds, seconds > 0 ? flops / seconds / 1e9 : 0.0);
  return kExitOk;
}

int Cancel(CoordinatorClient& client, const std::string& job_id, const std::string& reason,
           bool checkpoint, Streams io) {
  absl::StatusOr<v1::Job> job = client.Cancel(job_id, reason, checkpoint);
  if (!job.ok()) return Fail(job.status(), io);
  io.out << job->id() << " " << StateName(job->state()) << ": " << job->reason() << "\n";
  return kExitOk;
}

int Delete(CoordinatorClient& client, const std::string& job_id, Streams io) {
  if (absl::Status st = client.Delete(job_id); !st.ok()) return Fail(st, io);
  io.out << job_id << " deleted\n";
  return kExitOk;
}

int Prune(CoordinatorClient& client, absl::Duration older_than, Streams io) {
  if (older_than <= absl::ZeroDuration()) {
    io.err << "muonmeshctl prune: --older-than: required, a duration > 0 (e.g. 168h)\n";
    return kExitUsage;
  }
  absl::StatusOr<std::vector<std::string>> ids = client.Prune(absl::Now() - older_than);
  if (!ids.ok()) return Fail(ids.status(), io);
  for (const std::string& id : *ids) io.out << id << " deleted\n";
  io.out << ids->size() << " job(s) that finished before "
         << absl::FormatTime(absl::Now() - older_than) << " deleted\n";
  return kExitOk;
}

int Drain(CoordinatorClient& client, const std::string& worker_id, const std::string& reason,
          Streams io) {
  absl::StatusOr<v1::Worker> w = client.Drain(worker_id, reason);
  if (!w.ok()) return Fail(w.status(), io);
  io.out << w->info().worker_id() << " DRAINING"
         << (w->job_id().empty()
                 ? std::string(": idle; it leaves now")
                 : absl::StrCat(": job ", w->job_id(), " (rank ", w->rank(),
                                ") checkpoints at its next step and goes on on other workers; "
                                "then the worker leaves"))
         << "\n";
  return kExitOk;
}

int RemoveWorker(CoordinatorClient& client, const std::string& worker_id, Streams io) {
  if (absl::Status s = client.RemoveWorker(worker_id); !s.ok()) return Fail(s, io);
  io.out << worker_id << " removed\n";
  return kExitOk;
}

int RemoveLostWorkers(CoordinatorClient& client, Streams io) {
  absl::StatusOr<std::vector<v1::Worker>> workers = client.Workers();
  if (!workers.ok()) return Fail(workers.status(), io);
  int removed = 0;
  for (const v1::Worker& w : *workers) {
    if (w.state() != v1::WORKER_STATE_LOST) continue;
    // Gone meanwhile (forgotten, or removed by someone else): nothing to
    // do; registered again meanwhile: no longer lost, kept.
    absl::Status s = client.RemoveWorker(w.info().worker_id());
    if (s.code() == absl::StatusCode::kNotFound) continue;
    if (s.code() == absl::StatusCode::kFailedPrecondition) {
      io.out << w.info().worker_id() << " is back: kept\n";
      continue;
    }
    if (!s.ok()) return Fail(s, io);
    io.out << w.info().worker_id() << " removed\n";
    ++removed;
  }
  io.out << removed << " lost worker(s) removed\n";
  return kExitOk;
}

int Workers(CoordinatorClient& client, bool json, Streams io) {
  absl::StatusOr<std::vector<v1::Worker>> workers = client.Workers();
  if (!workers.ok()) return Fail(workers.status(), io);
  if (json) {
    v1::ListWorkersResponse all;
    for (const v1::Worker& w : *workers) *all.add_workers() = w;
    io.out << Json(all) << "\n";
    return kExitOk;
  }
  io.out << absl::StrFormat("%-28s %-6s %-6s %-22s %10s  %s\n", "WORKER", "DEVICE", "STATE",
                            "ADDRESS", "MEMORY", "JOB/RANK");
  for (const v1::Worker& w : *workers) {
    const std::string state =
        v1::WorkerState_Name(w.state()).substr(std::string("WORKER_STATE_").size());
    std::string quarantine;
    if (w.quarantined_until_unix_ms() > 0) {
      // Blamed for two failed attempts: no new rank until then.
      const absl::Duration left = absl::Trunc(
          absl::FromUnixMillis(w.quarantined_until_unix_ms()) - absl::Now(), absl::Seconds(1));
      quarantine = absl::StrCat("  QUARANTINED for ", absl::FormatDuration(left), ": ",
                                w.quarantine_reason());
    }
    io.out << absl::StrFormat(
        "%-28s %-6s %-6s %-22s %9.1fG  %s%s%s\n", w.info().worker_id(), w.info().device(), state,
        w.info().address(), static_cast<double>(w.info().memory_bytes()) / (1 << 30),
        w.job_id().empty() ? std::string("-") : absl::StrCat(w.job_id(), "/", w.rank()),
        w.info().locality().empty() ? "" : absl::StrCat("  in ", w.info().locality()),
        quarantine);
  }
  return kExitOk;
}

}  // namespace muonmesh::client
