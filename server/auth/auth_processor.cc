#include "server/auth/auth_processor.h"

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "grpc/grpc_security_constants.h"

namespace muonmesh::auth {
namespace {

absl::string_view View(const grpc::string_ref& s) { return absl::string_view(s.data(), s.size()); }

// The token of an "authorization: Bearer TOKEN" value, or nullopt when the
// value has another form.
std::optional<absl::string_view> BearerToken(absl::string_view value) {
  constexpr absl::string_view kBearer = "bearer ";
  if (value.size() <= kBearer.size() ||
      !absl::EqualsIgnoreCase(value.substr(0, kBearer.size()), kBearer)) {
    return std::nullopt;
  }
  return absl::StripAsciiWhitespace(value.substr(kBearer.size()));
}

}  // namespace

AuthProcessor::AuthProcessor(std::shared_ptr<TokenFile> tokens, AccessPolicyOptions options,
                             LineSink log)
    : tokens_(std::move(tokens)), options_(options), log_(std::move(log)) {}

grpc::Status AuthProcessor::Process(const InputMetadata& auth_metadata,
                                    grpc::AuthContext* context,
                                    OutputMetadata* consumed_auth_metadata,
                                    OutputMetadata* /*response_metadata*/) {
  absl::string_view method;
  if (const auto path = auth_metadata.find(":path"); path != auth_metadata.end()) {
    method = View(path->second);
  }
  Caller caller;
  if (const auto header = auth_metadata.find("authorization"); header != auth_metadata.end()) {
    caller.token_given = true;
    consumed_auth_metadata->insert(
        std::make_pair(std::string(View(header->first)), std::string(View(header->second))));
    const std::optional<absl::string_view> token = BearerToken(View(header->second));
    if (token.has_value() && tokens_ != nullptr) caller.role = tokens_->Current()->Find(*token);
  }
  caller.client_certificate =
      context != nullptr && !context->FindPropertyValues(GRPC_X509_PEM_CERT_PROPERTY_NAME).empty();
  const absl::Status decision = Authorize(method, caller, options_);
  if (decision.ok()) return grpc::Status::OK;
  LogDenial(absl::StrCat("denied ", method.empty() ? "(no method)" : method, ": ",
                         absl::StatusCodeToString(decision.code()), " (",
                         caller.role.has_value() ? absl::StrCat("role ", RoleName(*caller.role))
                         : caller.token_given    ? std::string("unknown token")
                                                 : std::string("no token"),
                         caller.client_certificate ? ", client certificate" : "", ")"));
  return grpc::Status(static_cast<grpc::StatusCode>(decision.code()),
                      std::string(decision.message()));
}

void AuthProcessor::LogDenial(const std::string& line) {
  if (!log_) return;
  std::string out;
  {
    absl::MutexLock lock(&mu_);
    const auto now = std::chrono::steady_clock::now();
    if (now - window_start_ >= std::chrono::minutes(1)) {
      if (left_out_ > 0) {
        out = absl::StrCat("(", left_out_, " more denials in the last minute were not logged)\n");
      }
      window_start_ = now;
      window_lines_ = 0;
      left_out_ = 0;
    }
    if (window_lines_ >= kMaxDenialLinesPerMinute) {
      ++left_out_;
      return;
    }
    ++window_lines_;
  }
  log_(out + line);
}

}  // namespace muonmesh::auth
