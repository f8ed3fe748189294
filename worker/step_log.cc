#include "worker/step_log.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace muonmesh::worker {
namespace {

// JSON has no NaN or infinity: write them as null.
std::string Number(double v) {
  if (!std::isfinite(v)) return "null";
  return absl::StrFormat("%.17g", v);
}

std::string Quoted(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      absl::StrAppendFormat(&out, "\\u%04x", static_cast<unsigned char>(c));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

}  // namespace

std::vector<std::pair<const char*, absl::Duration>> NamedPhases(const PhaseTimes& t) {
  return {{"param_gather", t.param_gather},
          {"forward_backward", t.forward_backward},
          {"expert_dispatch", t.expert_dispatch},
          {"grad_reduce", t.grad_reduce},
          {"adamw", t.adamw},
          {"muon_prepare", t.muon_prepare},
          {"muon_gather", t.muon_gather},
          {"newton_schulz", t.newton_schulz},
          {"muon_scatter", t.muon_scatter},
          {"muon_apply", t.muon_apply},
          {"param_allgather_after_step", t.param_allgather_after_step},
          {"grad_reduce_hidden", t.grad_reduce_hidden},
          {"param_gather_hidden", t.param_gather_hidden},
          {"muon_gather_hidden", t.muon_gather_hidden}};
}

absl::Duration OptimizerTime(const PhaseTimes& t) {
  return t.adamw + t.muon_prepare + t.muon_gather + t.newton_schulz + t.muon_scatter +
         t.muon_apply + t.param_allgather_after_step;
}

// `, "max_attn_logit": [...]` (models with attention), `, "expert_load":
// [{...}, ...]` (mixtures of experts) and `, "muon": {...}`.
std::string RecipeJson(const StepReport& r) {
  std::string out;
  if (!r.max_attn_logit.empty()) {
    absl::StrAppend(&out, ", \"max_attn_logit\": [");
    for (size_t i = 0; i < r.max_attn_logit.size(); ++i) {
      absl::StrAppend(&out, i ? ", " : "", Number(r.max_attn_logit[i]));
    }
    absl::StrAppend(&out, "]");
  }
  if (r.aux_loss.has_value()) absl::StrAppend(&out, ", \"aux_loss\": ", Number(*r.aux_loss));
  if (!r.expert_load.empty()) {
    absl::StrAppend(&out, ", \"expert_load\": [");
    for (size_t i = 0; i < r.expert_load.size(); ++i) {
      const ExpertLoad& e = r.expert_load[i];
      absl::StrAppend(&out, i ? ", " : "", "{\"layer\": ", e.layer,
                      ", \"min_over_mean\": ", Number(e.min_over_mean),
                      ", \"max_over_mean\": ", Number(e.max_over_mean),
                      ", \"dropped\": ", e.dropped, "}");
    }
    absl::StrAppend(&out, "]");
  }
  const MuonHealth& h = r.muon;
  absl::StrAppend(&out, ", \"muon\": {\"matrices\": ", h.matrices,
                  ", \"planned_matrices\": ", h.planned_matrices, ", \"elements\": ", h.elements,
                  ", \"planned_elements\": ", h.planned_elements,
                  ", \"update_rms\": ", Number(h.update_rms));
  if (h.ortho_error_max.has_value()) {
    absl::StrAppend(&out, ", \"ortho_error_max\": ", Number(*h.ortho_error_max),
                    ", \"ortho_error_median\": ", Number(h.ortho_error_median.value_or(0)));
  }
  absl::StrAppend(&out, "}");
  return out;
}

std::string StepJson(const StepReport& r, absl::Duration step_time, int32_t rank, int attempt) {
  const std::vector<std::pair<const char*, absl::Duration>> phases = NamedPhases(r.times);
  std::string out = absl::StrCat("{\"step\": ", r.step, ", \"attempt\": ", attempt,
                                 ", \"rank\": ", rank, ", \"loss\": ", Number(r.loss),
                                 r.val_loss.has_value()
                                     ? absl::StrCat(", \"val_loss\": ", Number(*r.val_loss))
                                     : std::string(),
                                 ", \"grad_norm\": ", Number(r.grad_norm),
                                 ", \"lr_scale\": ", Number(r.lr_scale), RecipeJson(r),
                                 ", \"step_seconds\": ", Number(absl::ToDoubleSeconds(step_time)),
                                 ", \"phases\": {");
  for (size_t i = 0; i < phases.size(); ++i) {
    absl::StrAppend(&out, i ? ", " : "", "\"", phases[i].first,
                    "\": ", Number(absl::ToDoubleSeconds(phases[i].second)));
  }
  absl::StrAppend(&out, "}, \"bytes_sent\": {");
  bool first = true;
  for (const auto& [name, bytes] : r.bytes_sent) {
    absl::StrAppend(&out, first ? "" : ", ", Quoted(name), ": ", bytes);
    first = false;
  }
  absl::StrAppend(&out, "}, \"ns_flops\": ", Number(r.ns_flops),
                  ", \"muon_exchange_calls\": ", r.muon_exchange_calls,
                  ", \"collective_calls\": ", r.collective_calls, ", \"muon_rounds\": [");
  for (size_t i = 0; i < r.muon_rounds.size(); ++i) {
    const MuonRound& m = r.muon_rounds[i];
    absl::StrAppend(&out, i ? ", " : "", "{\"wave\": ", m.wave, ", \"units\": [", m.first_unit,
                    ", ", m.end_unit, "], \"domain\": ", Quoted(m.domain),
                    ", \"ns_flops\": ", Number(m.ns_flops),
                    ", \"planned_ns_flops\": ", Number(m.planned_ns_flops),
                    ", \"planned_critical_ns_flops\": ", Number(m.planned_critical_ns_flops),
                    ", \"sent_bytes\": ", m.sent_bytes,
                    ", \"recv_bytes\": ", m.recv_bytes,
                    ", \"wait_ms\": ", Number(absl::ToDoubleMilliseconds(m.wait)), "}");
  }
  absl::StrAppend(&out, "]}");
  return out;
}

absl::StatusOr<std::unique_ptr<StepLog>> StepLog::Open(const std::string& output_dir,
                                                       int32_t rank, int attempt, bool append) {
  const std::filesystem::path dir = std::filesystem::path(output_dir) / "metrics";
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat(dir.string(), ": cannot create: ", ec.message()));
  }
  const std::string path = (dir / absl::StrFormat("rank-%d.jsonl", rank)).string();
  // Only a regular file (or nothing) may be opened for writing here.
  const auto type = std::filesystem::symlink_status(path, ec).type();
  if (type != std::filesystem::file_type::not_found &&
      type != std::filesystem::file_type::regular) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": exists and is not a regular file; refusing to write it"));
  }
  std::FILE* file = std::fopen(path.c_str(), append ? "a" : "w");
  if (file == nullptr) {
    return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot open"));
  }
  return std::unique_ptr<StepLog>(new StepLog(path, file, rank, attempt));
}

StepLog::~StepLog() { std::fclose(file_); }

absl::Status StepLog::Write(const StepReport& report, absl::Duration step_time) {
  const std::string line = StepJson(report, step_time, rank_, attempt_) + "\n";
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat(path_, ": cannot write"));
  }
  return absl::OkStatus();
}

}  // namespace muonmesh::worker
