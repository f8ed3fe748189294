#include "server/state/job_store.h"

#include <sqlite3.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "google/protobuf/util/message_differencer.h"

namespace muonmesh::coordinator {
namespace {

// 2: a job's spec in the specs table, not in its blob (1 read and moved on
// open).
constexpr const char* kSchemaVersion = "2";
constexpr const char* kOldSchemaVersion = "1";
constexpr int32_t kDefaultPage = 100;
constexpr int32_t kMaxPage = 1000;
constexpr int32_t kDefaultStepPage = 1000;
constexpr int32_t kMaxStepPage = 10000;

// Whether folder `a` is `b` or lies inside it (lexically: the paths a
// coordinator sees are absolute and normalized by the client).
bool SameOrInside(const std::filesystem::path& a, const std::filesystem::path& b) {
  auto ai = a.begin();
  for (auto bi = b.begin(); bi != b.end(); ++bi, ++ai) {
    if (bi->empty()) continue;  // a trailing separator
    if (ai == a.end() || *ai != *bi) return false;
  }
  return true;
}

// What two jobs must not share while both are unfinished: the output folder
// (metrics, checkpoints, the default export) and the export file. Empty
// when `spec` and `other` can run together; otherwise why not.
std::string OutputOverlap(const v1::JobSpec& spec, const v1::JobSpec& other) {
  const std::filesystem::path dir = std::filesystem::path(spec.output().dir()).lexically_normal();
  const std::filesystem::path other_dir =
      std::filesystem::path(other.output().dir()).lexically_normal();
  if (!spec.output().dir().empty() && !other.output().dir().empty()) {
    if (dir == other_dir) return absl::StrCat("its output folder ", dir.string());
    if (SameOrInside(dir, other_dir)) {
      return absl::StrCat("the output folder ", other_dir.string(), ", which holds ",
                          dir.string());
    }
    if (SameOrInside(other_dir, dir)) {
      return absl::StrCat("the output folder ", other_dir.string(), ", inside ", dir.string());
    }
  }
  const std::filesystem::path file =
      std::filesystem::path(spec.output().export_()).lexically_normal();
  const std::filesystem::path other_file =
      std::filesystem::path(other.output().export_()).lexically_normal();
  if (!spec.output().export_().empty()) {
    if (file == other_file) return absl::StrCat("its export file ", file.string());
    if (!other.output().dir().empty() && SameOrInside(file, other_dir)) {
      return absl::StrCat("the output folder ", other_dir.string(), ", which holds this job's "
                          "export file ", file.string());
    }
  }
  if (!other.output().export_().empty() && !spec.output().dir().empty() &&
      SameOrInside(other_file, dir)) {
    return absl::StrCat("its export file ", other_file.string(), ", inside ", dir.string());
  }
  return "";
}

// "RUNNING" for JOB_STATE_RUNNING.
std::string ShortStateName(v1::JobState s) {
  const std::string name = v1::JobState_Name(s);
  constexpr absl::string_view kPrefix = "JOB_STATE_";
  return absl::StartsWith(name, kPrefix) ? name.substr(kPrefix.size()) : name;
}

// One prepared statement; finalized on destruction.
class Statement {
 public:
  Statement(sqlite3* db, const char* sql) : db_(db) {
    rc_ = sqlite3_prepare_v2(db, sql, -1, &stmt_, nullptr);
  }
  ~Statement() { sqlite3_finalize(stmt_); }
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;

  Statement& Int(int i, int64_t v) {
    if (rc_ == SQLITE_OK) rc_ = sqlite3_bind_int64(stmt_, i, v);
    return *this;
  }
  Statement& Text(int i, const std::string& v) {
    if (rc_ == SQLITE_OK) {
      rc_ = sqlite3_bind_text(stmt_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
    }
    return *this;
  }
  Statement& Blob(int i, const std::string& v) {
    if (rc_ == SQLITE_OK) {
      rc_ = sqlite3_bind_blob(stmt_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
    }
    return *this;
  }
  // SQLITE_ROW, SQLITE_DONE or an error code.
  int Step() {
    if (rc_ != SQLITE_OK) return rc_;
    return sqlite3_step(stmt_);
  }
  // Runs a statement that returns no rows.
  absl::Status Run(const char* what) {
    const int rc = Step();
    if (rc == SQLITE_DONE) return absl::OkStatus();
    return Error(what);
  }
  absl::Status Error(const char* what) const {
    return absl::InternalError(absl::StrCat("job store: ", what, ": ", sqlite3_errmsg(db_)));
  }
  int64_t ColumnInt(int i) const { return sqlite3_column_int64(stmt_, i); }
  bool IsNull(int i) const { return sqlite3_column_type(stmt_, i) == SQLITE_NULL; }
  std::string ColumnBytes(int i) const {
    const void* p = sqlite3_column_blob(stmt_, i);
    const int n = sqlite3_column_bytes(stmt_, i);
    return p == nullptr ? std::string() : std::string(static_cast<const char*>(p), n);
  }

 private:
  sqlite3* db_;
  sqlite3_stmt* stmt_ = nullptr;
  int rc_ = SQLITE_OK;
};

// BEGIN IMMEDIATE ... COMMIT; rolls back unless committed.
class Transaction {
 public:
  explicit Transaction(sqlite3* db) : db_(db) {
    ok_ = sqlite3_exec(db_, "BEGIN IMMEDIATE", nullptr, nullptr, nullptr) == SQLITE_OK;
  }
  ~Transaction() {
    if (ok_ && !committed_) sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
  }
  absl::Status Begun() const {
    if (ok_) return absl::OkStatus();
    return absl::InternalError(absl::StrCat("job store: begin: ", sqlite3_errmsg(db_)));
  }
  absl::Status Commit() {
    if (sqlite3_exec(db_, "COMMIT", nullptr, nullptr, nullptr) != SQLITE_OK) {
      return absl::InternalError(absl::StrCat("job store: commit: ", sqlite3_errmsg(db_)));
    }
    committed_ = true;
    return absl::OkStatus();
  }

 private:
  sqlite3* db_;
  bool ok_ = false;
  bool committed_ = false;
};

std::string Serialized(const google::protobuf::Message& m) {
  std::string out;
  m.SerializeToString(&out);
  return out;
}

// A job's blob: everything but its spec (lent out for the serialization, not
// copied), which is stored apart once.
std::string BlobWithoutSpec(v1::Job& job) {
  std::unique_ptr<v1::JobSpec> spec(job.release_spec());
  std::string blob = Serialized(job);
  job.set_allocated_spec(spec.release());
  return blob;
}

int32_t PageSize(int32_t asked, int32_t fallback, int32_t most) {
  if (asked <= 0) return fallback;
  return std::min(asked, most);
}

}  // namespace

JobStore::JobStore(sqlite3* db) : db_(db) {}

JobStore::~JobStore() { sqlite3_close(db_); }

absl::Status JobStore::Exec(const char* sql) const {
  char* error = nullptr;
  if (sqlite3_exec(db_, sql, nullptr, nullptr, &error) == SQLITE_OK) return absl::OkStatus();
  std::string message = error != nullptr ? error : sqlite3_errmsg(db_);
  sqlite3_free(error);
  return absl::InternalError(absl::StrCat("job store: ", message));
}

absl::StatusOr<std::unique_ptr<JobStore>> JobStore::Open(const std::string& path) {
  sqlite3* db = nullptr;
  const int rc = sqlite3_open_v2(path.c_str(), &db,
                                 SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX,
                                 nullptr);
  if (rc != SQLITE_OK) {
    std::string why = db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
    sqlite3_close(db);
    return absl::InvalidArgumentError(absl::StrCat(path, ": cannot open the database: ", why));
  }
  std::unique_ptr<JobStore> store(new JobStore(db));
  sqlite3_busy_timeout(db, 5000);
  absl::Status st = store->Exec(
      "PRAGMA journal_mode=WAL;"
      "PRAGMA synchronous=FULL;"
      "CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);"
      "CREATE TABLE IF NOT EXISTS jobs(seq INTEGER PRIMARY KEY, id TEXT UNIQUE NOT NULL,"
      "  request_id TEXT NOT NULL, job BLOB NOT NULL);"
      "CREATE TABLE IF NOT EXISTS specs(seq INTEGER PRIMARY KEY, spec BLOB NOT NULL);"
      "CREATE TABLE IF NOT EXISTS events(seq INTEGER NOT NULL, idx INTEGER NOT NULL,"
      "  event BLOB NOT NULL, PRIMARY KEY(seq, idx)) WITHOUT ROWID;"
      "CREATE TABLE IF NOT EXISTS steps(seq INTEGER NOT NULL, step INTEGER NOT NULL,"
      "  rank INTEGER NOT NULL, record BLOB NOT NULL, PRIMARY KEY(seq, step, rank))"
      "  WITHOUT ROWID;");
  if (!st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a muonmesh state database: ", st.message()));
  }
  {
    Statement get(db, "SELECT value FROM meta WHERE key = 'schema'");
    const int r = get.Step();
    if (r == SQLITE_ROW) {
      if (get.ColumnBytes(0) != kSchemaVersion && get.ColumnBytes(0) != kOldSchemaVersion) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": state of schema ", get.ColumnBytes(0), ", this coordinator reads ",
            kSchemaVersion));
      }
    } else {
      Statement put(db, "INSERT INTO meta(key, value) VALUES('schema', ?)");
      MUONMESH_RETURN_IF_ERROR(put.Text(1, kSchemaVersion).Run("write schema"));
    }
  }
  {
    absl::MutexLock lock(&store->mu_);  // nobody else has the store yet
    if (absl::Status s = store->Load(); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", s.message()));
    }
  }
  return store;
}

absl::Status JobStore::Load() {
  Statement q(db_,
              "SELECT jobs.seq, jobs.job, specs.spec FROM jobs LEFT JOIN specs "
              "ON specs.seq = jobs.seq ORDER BY jobs.seq");
  std::vector<int64_t> spec_inside;  // rows of schema 1
  int rc;
  while ((rc = q.Step()) == SQLITE_ROW) {
    Row row;
    row.seq = q.ColumnInt(0);
    if (!row.job.ParseFromString(q.ColumnBytes(1))) {
      return absl::DataLossError(absl::StrCat("job of seq ", row.seq, " does not parse"));
    }
    if (q.IsNull(2)) {
      spec_inside.push_back(row.seq);
    } else if (!row.job.mutable_spec()->ParseFromString(q.ColumnBytes(2))) {
      return absl::DataLossError(absl::StrCat("spec of seq ", row.seq, " does not parse"));
    }
    by_id_[row.job.id()] = row.seq;
    if (!row.job.request_id().empty()) by_request_[row.job.request_id()] = row.seq;
    next_seq_ = std::max(next_seq_, row.seq + 1);
    CountUnfinished(row.job, 1);
    rows_.emplace(row.seq, std::move(row));
  }
  if (rc != SQLITE_DONE) return q.Error("load jobs");
  MUONMESH_RETURN_IF_ERROR(MoveSpecsApart(spec_inside));
  Statement put(db_, "INSERT OR REPLACE INTO meta(key, value) VALUES('schema', ?)");
  return put.Text(1, kSchemaVersion).Run("write schema");
}

absl::Status JobStore::MoveSpecsApart(const std::vector<int64_t>& seqs) {
  if (seqs.empty()) return absl::OkStatus();
  Transaction tx(db_);
  MUONMESH_RETURN_IF_ERROR(tx.Begun());
  for (const int64_t seq : seqs) {
    Row& row = rows_.at(seq);
    Statement spec(db_, "INSERT INTO specs(seq, spec) VALUES(?, ?)");
    MUONMESH_RETURN_IF_ERROR(
        spec.Int(1, seq).Blob(2, Serialized(row.job.spec())).Run("move a spec apart"));
    MUONMESH_RETURN_IF_ERROR(WriteJob(seq, row.job));
  }
  return tx.Commit();
}

absl::Status JobStore::WriteJob(int64_t seq, v1::Job& job) {
  Statement write(db_, "UPDATE jobs SET job = ? WHERE seq = ?");
  return write.Blob(1, BlobWithoutSpec(job)).Int(2, seq).Run("update job");
}

void JobStore::CountUnfinished(const v1::Job& job, int64_t delta) {
  if (IsFinal(job.state())) return;
  unfinished_ += delta;
  if (job.submitted_by().empty()) return;
  auto it = unfinished_by_client_.try_emplace(job.submitted_by(), 0).first;
  it->second += delta;
  if (it->second <= 0) unfinished_by_client_.erase(it);
}

absl::Status JobStore::AdmitsLocked(const std::string& client) const {
  if (limits_.unfinished > 0 && unfinished_ >= limits_.unfinished) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the coordinator holds ", unfinished_,
                     " unfinished jobs, its limit; submit again when "
                     "some have finished (or cancel some)"));
  }
  if (limits_.unfinished_per_client > 0 && !client.empty()) {
    auto it = unfinished_by_client_.find(client);
    if (it != unfinished_by_client_.end() && it->second >= limits_.unfinished_per_client) {
      return absl::ResourceExhaustedError(
          absl::StrCat("client ", client, " has ", it->second,
                       " unfinished jobs, the limit per client; "
                       "submit again when some have finished (or cancel some)"));
    }
  }
  return absl::OkStatus();
}

absl::Status JobStore::Admits(const std::string& request_id, const std::string& client) const {
  absl::MutexLock lock(&mu_);
  if (!request_id.empty() && by_request_.contains(request_id)) return absl::OkStatus();
  return AdmitsLocked(client);
}

void JobStore::SetLimits(Limits limits) {
  absl::MutexLock lock(&mu_);
  limits_ = limits;
}

int64_t JobStore::UnfinishedCount() const {
  absl::MutexLock lock(&mu_);
  return unfinished_;
}

int64_t JobStore::UnfinishedCountOf(const std::string& client) const {
  absl::MutexLock lock(&mu_);
  auto it = unfinished_by_client_.find(client);
  return it == unfinished_by_client_.end() ? 0 : it->second;
}

absl::StatusOr<JobStore::Submitted> JobStore::Submit(const std::string& request_id,
                                                     const v1::JobSpec& spec,
                                                     const std::string& reason, int64_t now_ms,
                                                     const std::string& client) {
  if (request_id.size() > kMaxRequestIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("request_id: ", request_id.size(),
                                                   " bytes exceed the limit of ",
                                                   kMaxRequestIdBytes));
  }
  absl::MutexLock lock(&mu_);
  if (!request_id.empty()) {
    if (auto it = by_request_.find(request_id); it != by_request_.end()) {
      const v1::Job& earlier = rows_.at(it->second).job;
      if (!google::protobuf::util::MessageDifferencer::Equals(earlier.spec(), spec)) {
        return absl::AlreadyExistsError(absl::StrCat(
            "request_id '", request_id, "' was used for job ", earlier.id(),
            " with another spec; use a new request_id for a new job"));
      }
      return Submitted{earlier, false};
    }
  }
  MUONMESH_RETURN_IF_ERROR(AdmitsLocked(client));
  for (const auto& [seq, other] : rows_) {
    if (IsFinal(other.job.state())) continue;
    const std::string overlap = OutputOverlap(spec, other.job.spec());
    if (overlap.empty()) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "output.dir: this job would share ", overlap, " with job ", other.job.id(), " (",
        other.job.name(), ", ", ShortStateName(other.job.state()),
        "), which has not finished; two jobs writing one folder tear each other's metrics, "
        "checkpoints and export. Give this job another output.dir (or name), or wait for ",
        other.job.id(), " to end (muonmeshctl cancel ", other.job.id(), " stops it)"));
  }
  Row row;
  row.seq = next_seq_;
  v1::Job& job = row.job;
  job.set_id(absl::StrCat("j-", row.seq));
  job.set_name(spec.name());
  *job.mutable_spec() = spec;
  job.set_state(v1::JOB_STATE_PENDING);
  job.set_reason(reason);
  job.set_request_id(request_id);
  job.set_submitted_by(client);
  job.set_submitted_unix_ms(now_ms);
  job.set_steps_total(spec.training().steps());
  job.set_last_loss(std::numeric_limits<double>::quiet_NaN());
  job.set_last_event_index(1);
  v1::JobEvent event;
  event.set_index(1);
  event.set_unix_ms(now_ms);
  event.mutable_state_change()->set_state(v1::JOB_STATE_PENDING);
  event.mutable_state_change()->set_reason(reason);

  Transaction tx(db_);
  MUONMESH_RETURN_IF_ERROR(tx.Begun());
  Statement insert(db_, "INSERT INTO jobs(seq, id, request_id, job) VALUES(?, ?, ?, ?)");
  MUONMESH_RETURN_IF_ERROR(insert.Int(1, row.seq)
                               .Text(2, job.id())
                               .Text(3, request_id)
                               .Blob(4, BlobWithoutSpec(job))
                               .Run("insert job"));
  Statement put_spec(db_, "INSERT INTO specs(seq, spec) VALUES(?, ?)");
  MUONMESH_RETURN_IF_ERROR(
      put_spec.Int(1, row.seq).Blob(2, Serialized(job.spec())).Run("insert spec"));
  Statement ev(db_, "INSERT INTO events(seq, idx, event) VALUES(?, ?, ?)");
  MUONMESH_RETURN_IF_ERROR(
      ev.Int(1, row.seq).Int(2, 1).Blob(3, Serialized(event)).Run("insert event"));
  MUONMESH_RETURN_IF_ERROR(tx.Commit());
  ++next_seq_;
  by_id_[job.id()] = row.seq;
  if (!request_id.empty()) by_request_[request_id] = row.seq;
  CountUnfinished(row.job, 1);
  v1::Job answer = row.job;
  rows_.emplace(row.seq, std::move(row));
  return Submitted{std::move(answer), true};
}

absl::StatusOr<const JobStore::Row*> JobStore::Find(const std::string& job_id) const {
  auto it = by_id_.find(job_id);
  if (it == by_id_.end()) {
    return absl::NotFoundError(absl::StrCat("no job '", job_id.substr(0, 64), "'"));
  }
  return &rows_.at(it->second);
}

absl::Status JobStore::Ping() const {
  absl::MutexLock lock(&mu_);
  Statement q(db_, "SELECT value FROM meta WHERE key = 'schema'");
  if (q.Step() != SQLITE_ROW) return q.Error("read the schema");
  return absl::OkStatus();
}

absl::StatusOr<int64_t> JobStore::LastEventIndex(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  MUONMESH_ASSIGN_OR_RETURN(const Row* row, Find(job_id));
  return row->job.last_event_index();
}

absl::StatusOr<v1::Job> JobStore::Get(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  MUONMESH_ASSIGN_OR_RETURN(const Row* row, Find(job_id));
  return row->job;
}

absl::StatusOr<JobStore::Page> JobStore::List(const std::vector<v1::JobState>& states,
                                              const std::string& name, int32_t page_size,
                                              const std::string& page_token) const {
  // The token is the seq to continue below.
  int64_t below = std::numeric_limits<int64_t>::max();
  if (!page_token.empty() && (!absl::SimpleAtoi(page_token, &below) || below < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_token: '", page_token.substr(0, 64), "' is not a token of ListJobs"));
  }
  const int32_t want = PageSize(page_size, kDefaultPage, kMaxPage);
  absl::MutexLock lock(&mu_);
  Page page;
  int64_t last_seq = 0;
  for (auto it = std::make_reverse_iterator(rows_.lower_bound(below)); it != rows_.rend(); ++it) {
    const v1::Job& job = it->second.job;
    if (!states.empty() && std::find(states.begin(), states.end(), job.state()) == states.end()) {
      continue;
    }
    if (!name.empty() && job.name() != name) continue;
    if (static_cast<int32_t>(page.jobs.size()) == want) {
      page.next_page_token = absl::StrCat(last_seq);
      break;
    }
    page.jobs.push_back(job);
    last_seq = it->first;
  }
  return page;
}

std::vector<v1::Job> JobStore::Unfinished() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::Job> out;
  for (const auto& [seq, row] : rows_) {
    if (!IsFinal(row.job.state())) out.push_back(row.job);
  }
  return out;
}

std::vector<JobStore::Summary> JobStore::UnfinishedSummaries() const {
  absl::MutexLock lock(&mu_);
  std::vector<Summary> out;
  out.reserve(static_cast<size_t>(unfinished_));
  for (const auto& [seq, row] : rows_) {
    const v1::Job& job = row.job;
    if (IsFinal(job.state())) continue;
    out.push_back({job.id(), job.state(), job.attempt(), job.spec().device(),
                   job.spec().world_size(), job.spec().training().has_elastic()});
  }
  return out;
}

std::vector<std::pair<v1::JobState, int64_t>> JobStore::CountByState() const {
  absl::MutexLock lock(&mu_);
  std::map<v1::JobState, int64_t> counts;
  for (const auto& [seq, row] : rows_) counts[row.job.state()] += 1;
  return {counts.begin(), counts.end()};
}

absl::StatusOr<v1::JobEvent> JobStore::Append(const std::string& job_id, v1::JobEvent event,
                                              int64_t now_ms,
                                              const std::function<void(v1::Job&)>& update) {
  absl::MutexLock lock(&mu_);
  MUONMESH_ASSIGN_OR_RETURN(const Row* found, Find(job_id));
  const Row& row = *found;
  v1::Job job = row.job;
  if (update) update(job);
  event.set_index(job.last_event_index() + 1);
  event.set_unix_ms(now_ms);
  job.set_last_event_index(event.index());

  Transaction tx(db_);
  MUONMESH_RETURN_IF_ERROR(tx.Begun());
  MUONMESH_RETURN_IF_ERROR(WriteJob(row.seq, job));
  Statement ev(db_, "INSERT INTO events(seq, idx, event) VALUES(?, ?, ?)");
  MUONMESH_RETURN_IF_ERROR(
      ev.Int(1, row.seq).Int(2, event.index()).Blob(3, Serialized(event)).Run("insert event"));
  MUONMESH_RETURN_IF_ERROR(tx.Commit());
  CountUnfinished(row.job, -1);
  CountUnfinished(job, 1);
  rows_.at(row.seq).job = std::move(job);
  return event;
}

absl::Status JobStore::Update(const std::string& job_id,
                              const std::function<void(v1::Job&)>& update) {
  absl::MutexLock lock(&mu_);
  MUONMESH_ASSIGN_OR_RETURN(const Row* found, Find(job_id));
  v1::Job job = found->job;
  update(job);
  MUONMESH_RETURN_IF_ERROR(WriteJob(found->seq, job));
  CountUnfinished(found->job, -1);
  CountUnfinished(job, 1);
  rows_.at(found->seq).job = std::move(job);
  return absl::OkStatus();
}

absl::Status JobStore::Delete(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  MUONMESH_ASSIGN_OR_RETURN(const Row* found, Find(job_id));
  const int64_t seq = found->seq;
  Transaction tx(db_);
  MUONMESH_RETURN_IF_ERROR(tx.Begun());
  for (const char* sql : {"DELETE FROM steps WHERE seq = ?", "DELETE FROM events WHERE seq = ?",
                          "DELETE FROM specs WHERE seq = ?", "DELETE FROM jobs WHERE seq = ?"}) {
    Statement del(db_, sql);
    MUONMESH_RETURN_IF_ERROR(del.Int(1, seq).Run("delete job"));
  }
  MUONMESH_RETURN_IF_ERROR(tx.Commit());
  CountUnfinished(found->job, -1);
  if (!found->job.request_id().empty()) by_request_.erase(found->job.request_id());
  by_id_.erase(job_id);
  rows_.erase(seq);
  return absl::OkStatus();
}

std::vector<std::string> JobStore::FinishedBefore(int64_t unix_ms) const {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<int64_t, std::string>> found;
  for (const auto& [seq, row] : rows_) {
    const v1::JobState s = row.job.state();
    const bool final =
        s == v1::JOB_STATE_SUCCEEDED || s == v1::JOB_STATE_FAILED || s == v1::JOB_STATE_CANCELLED;
    if (final && row.job.finished_unix_ms() < unix_ms) {
      found.emplace_back(row.job.finished_unix_ms(), row.job.id());
    }
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> ids;
  for (auto& [ms, id] : found) ids.push_back(std::move(id));
  return ids;
}

absl::StatusOr<std::vector<v1::JobEvent>> JobStore::Events(const std::string& job_id,
                                                           int64_t from_index,
                                                           int32_t limit) const {
  absl::MutexLock lock(&mu_);
  MUONMESH_ASSIGN_OR_RETURN(const Row* row, Find(job_id));
  Statement q(db_, "SELECT event FROM events WHERE seq = ? AND idx >= ? ORDER BY idx LIMIT ?");
  q.Int(1, row->seq).Int(2, from_index).Int(3, std::max(limit, 1));
  std::vector<v1::JobEvent> out;
  int rc;
  while ((rc = q.Step()) == SQLITE_ROW) {
    v1::JobEvent& e = out.emplace_back();
    if (!e.ParseFromString(q.ColumnBytes(0))) {
      return absl::DataLossError(absl::StrCat("job store: an event of ", job_id, " does not parse"));
    }
  }
  if (rc != SQLITE_DONE) return q.Error("read events");
  return out;
}

absl::Status JobStore::SetReadOnlyForTest(bool read_only) {
  absl::MutexLock lock(&mu_);
  return Exec(read_only ? "PRAGMA query_only = 1" : "PRAGMA query_only = 0");
}

absl::Status JobStore::PutStep(const std::string& job_id, const v1::StepRecord& record) {
  absl::MutexLock lock(&mu_);
  MUONMESH_ASSIGN_OR_RETURN(const Row* row, Find(job_id));
  Statement put(db_,
                "INSERT OR REPLACE INTO steps(seq, step, rank, record) VALUES(?, ?, ?, ?)");
  return put.Int(1, row->seq)
      .Int(2, record.step())
      .Int(3, record.rank())
      .Blob(4, Serialized(record))
      .Run("store a step record");
}

absl::StatusOr<JobStore::StepPage> JobStore::Steps(const std::string& job_id, int64_t first_step,
                                                   int64_t last_step, int32_t rank,
                                                   int32_t page_size,
                                                   const std::string& page_token) const {
  // The token is "step:rank" of the first record of the next page.
  int64_t from_step = first_step;
  int64_t from_rank = 0;
  if (!page_token.empty()) {
    const size_t colon = page_token.find(':');
    if (colon == std::string::npos ||
        !absl::SimpleAtoi(page_token.substr(0, colon), &from_step) ||
        !absl::SimpleAtoi(page_token.substr(colon + 1), &from_rank)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "page_token: '", page_token.substr(0, 64), "' is not a token of GetJobMetrics"));
    }
  }
  const int32_t want = PageSize(page_size, kDefaultStepPage, kMaxStepPage);
  absl::MutexLock lock(&mu_);
  MUONMESH_ASSIGN_OR_RETURN(const Row* row, Find(job_id));
  Statement q(db_,
              "SELECT record FROM steps WHERE seq = ?1 AND (step, rank) >= (?2, ?3)"
              " AND step >= ?4 AND (?5 < 0 OR step <= ?5) AND (?6 < 0 OR rank = ?6)"
              " ORDER BY step, rank LIMIT ?7");
  q.Int(1, row->seq)
      .Int(2, from_step)
      .Int(3, from_rank)
      .Int(4, first_step)
      .Int(5, last_step)
      .Int(6, rank)
      .Int(7, int64_t{want} + 1);
  StepPage page;
  int rc;
  while ((rc = q.Step()) == SQLITE_ROW) {
    v1::StepRecord r;
    if (!r.ParseFromString(q.ColumnBytes(0))) {
      return absl::DataLossError(
          absl::StrCat("job store: a step record of ", job_id, " does not parse"));
    }
    if (static_cast<int32_t>(page.records.size()) == want) {
      page.next_page_token = absl::StrCat(r.step(), ":", r.rank());
      break;
    }
    page.records.push_back(std::move(r));
  }
  if (rc != SQLITE_DONE && rc != SQLITE_ROW) return q.Error("read step records");
  return page;
}

bool IsFinal(v1::JobState s) {
  return s == v1::JOB_STATE_SUCCEEDED || s == v1::JOB_STATE_FAILED ||
         s == v1::JOB_STATE_CANCELLED;
}

}  // namespace muonmesh::coordinator
