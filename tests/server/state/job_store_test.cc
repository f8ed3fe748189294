// The coordinator's durable state on a real SQLite file: what Submit
// acknowledges survives a reopen, request ids make one job, events get
// gapless indices, paging visits every job once, and step records page by
// (step, rank).

#include "server/state/job_store.h"

#include <sqlite3.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace muonmesh::coordinator {
namespace {

using ::testing::HasSubstr;

std::string FreshDb(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/job_store_" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir + "/state.db";
}

v1::JobSpec Spec(const std::string& name, int64_t steps = 10) {
  v1::JobSpec spec;
  spec.set_name(name);
  spec.set_world_size(2);
  spec.mutable_training()->set_steps(steps);
  return spec;
}

TEST(JobStoreTest, SubmittedJobsSurviveAReopen) {
  const std::string db = FreshDb("reopen");
  std::string id;
  {
    auto store = JobStore::Open(db);
    ASSERT_TRUE(store.ok()) << store.status();
    auto s = (*store)->Submit("req-1", Spec("a"), "waiting", 1000);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_TRUE(s->created);
    EXPECT_EQ(s->job.state(), v1::JOB_STATE_PENDING);
    EXPECT_EQ(s->job.steps_total(), 10);
    EXPECT_TRUE(std::isnan(s->job.last_loss()));
    id = s->job.id();
    v1::JobEvent running;
    running.mutable_state_change()->set_state(v1::JOB_STATE_RUNNING);
    auto e = (*store)->Append(id, running, 2000,
                              [](v1::Job& j) { j.set_state(v1::JOB_STATE_RUNNING); });
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ(e->index(), 2);
  }
  auto store = JobStore::Open(db);
  ASSERT_TRUE(store.ok()) << store.status();
  auto job = (*store)->Get(id);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job->last_event_index(), 2);
  EXPECT_EQ(job->spec().name(), "a");
  // New ids continue after the old ones; the request id is still known.
  auto again = (*store)->Submit("req-1", Spec("a"), "waiting", 3000);
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->created);
  EXPECT_EQ(again->job.id(), id);
  auto next = (*store)->Submit("", Spec("b"), "waiting", 3000);
  ASSERT_TRUE(next.ok());
  EXPECT_NE(next->job.id(), id);
  EXPECT_EQ((*store)->Unfinished().size(), 2u);
}

TEST(JobStoreTest, RequestIdWithAnotherSpecIsRefused) {
  auto store = JobStore::Open(FreshDb("request"));
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Submit("r", Spec("a"), "", 1).ok());
  auto other = (*store)->Submit("r", Spec("a", 11), "", 2);
  EXPECT_EQ(other.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(other.status().message()), HasSubstr("j-1"));
  EXPECT_EQ((*store)->Submit(std::string(129, 'x'), Spec("a"), "", 3).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Without a request id, every submit is a new job.
  auto a = (*store)->Submit("", Spec("a"), "", 4);
  auto b = (*store)->Submit("", Spec("a"), "", 5);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->job.id(), b->job.id());
}

v1::JobSpec Writing(const std::string& name, const std::string& dir,
                    const std::string& export_path = "") {
  v1::JobSpec spec = Spec(name);
  spec.mutable_output()->set_dir(dir);
  if (!export_path.empty()) spec.mutable_output()->set_export_(export_path);
  return spec;
}

// Two unfinished jobs never share an output folder (or export file): the
// second submit is refused naming the first, whatever the nesting, until
// the first is final. The regression: two submits of one job file both ran
// and tore metrics/rank-0.jsonl.
TEST(JobStoreTest, AnUnfinishedJobsOutputFolderIsItsOwn) {
  auto store = JobStore::Open(FreshDb("outputs"));
  ASSERT_TRUE(store.ok());
  auto first = (*store)->Submit("req-a", Writing("a", "/runs/a"), "", 1);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string id = first->job.id();
  for (const v1::JobSpec& clash :
       {Writing("a", "/runs/a"), Writing("b", "/runs/a/"), Writing("b", "/runs/a/inner"),
        Writing("b", "/runs"), Writing("b", "/runs/x/../a"),
        Writing("b", "/other", "/runs/a/final.safetensors")}) {
    SCOPED_TRACE(clash.output().dir());
    auto refused = (*store)->Submit("", clash, "", 2);
    ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr("output.dir"));
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr(id));
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr("PENDING"));
  }
  // Same-prefix siblings are other folders; the same request is the same job.
  EXPECT_TRUE((*store)->Submit("", Writing("c", "/runs/a2"), "", 3).ok());
  EXPECT_TRUE((*store)->Submit("", Writing("d", "/runs/b"), "", 3).ok());
  auto again = (*store)->Submit("req-a", Writing("a", "/runs/a"), "", 4);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(again->created);
  EXPECT_EQ((*store)->UnfinishedCount(), 3);
  // Once the first has ended, its folder may be written again (a resume
  // or a new run of the same job file).
  v1::JobEvent done;
  done.mutable_state_change()->set_state(v1::JOB_STATE_CANCELLED);
  ASSERT_TRUE((*store)
                  ->Append(id, done, 5, [](v1::Job& j) { j.set_state(v1::JOB_STATE_CANCELLED); })
                  .ok());
  EXPECT_TRUE((*store)->Submit("", Writing("a", "/runs/a"), "", 6).ok());
}

TEST(JobStoreTest, EventsAreGaplessAndReadFromAnyIndex) {
  auto store = JobStore::Open(FreshDb("events"));
  ASSERT_TRUE(store.ok());
  auto s = (*store)->Submit("", Spec("a"), "", 1);
  ASSERT_TRUE(s.ok());
  for (int step = 0; step < 20; ++step) {
    v1::JobEvent e;
    e.mutable_step()->set_step(step);
    ASSERT_TRUE((*store)->Append(s->job.id(), e, 10 + step, nullptr).ok());
  }
  auto all = (*store)->Events(s->job.id(), 0, 1000);
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->size(), 21u);
  for (size_t i = 0; i < all->size(); ++i) EXPECT_EQ((*all)[i].index(), static_cast<int64_t>(i + 1));
  auto tail = (*store)->Events(s->job.id(), 15, 3);
  ASSERT_TRUE(tail.ok());
  ASSERT_EQ(tail->size(), 3u);
  EXPECT_EQ((*tail)[0].index(), 15);
  EXPECT_EQ((*tail)[0].step().step(), 13);
  EXPECT_EQ((*store)->Events("j-999", 0, 10).status().code(), absl::StatusCode::kNotFound);
}

TEST(JobStoreTest, ListPagesVisitEveryMatchingJobOnceNewestFirst) {
  auto store = JobStore::Open(FreshDb("list"));
  ASSERT_TRUE(store.ok());
  std::vector<std::string> ids;
  for (int i = 0; i < 25; ++i) {
    auto s = (*store)->Submit("", Spec(i % 2 == 0 ? "even" : "odd"), "", i);
    ASSERT_TRUE(s.ok());
    ids.push_back(s->job.id());
  }
  // Cancel every third job.
  for (int i = 0; i < 25; i += 3) {
    v1::JobEvent e;
    e.mutable_state_change()->set_state(v1::JOB_STATE_CANCELLED);
    ASSERT_TRUE((*store)->Append(ids[i], e, 100, [](v1::Job& j) {
      j.set_state(v1::JOB_STATE_CANCELLED);
    }).ok());
  }
  std::vector<std::string> seen;
  std::string token;
  int pages = 0;
  do {
    auto page = (*store)->List({v1::JOB_STATE_PENDING}, "even", 4, token);
    ASSERT_TRUE(page.ok()) << page.status();
    for (const v1::Job& j : page->jobs) seen.push_back(j.id());
    token = page->next_page_token;
    ++pages;
  } while (!token.empty() && pages < 100);
  std::vector<std::string> expected;
  for (int i = 24; i >= 0; --i) {
    if (i % 2 == 0 && i % 3 != 0) expected.push_back(ids[i]);
  }
  EXPECT_EQ(seen, expected);
  EXPECT_EQ((*store)->List({}, "", 0, "garbage").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(JobStoreTest, StepRecordsPageByStepAndRank) {
  auto store = JobStore::Open(FreshDb("steps"));
  ASSERT_TRUE(store.ok());
  auto s = (*store)->Submit("", Spec("a"), "", 1);
  ASSERT_TRUE(s.ok());
  for (int step = 0; step < 10; ++step) {
    for (int rank = 0; rank < 3; ++rank) {
      v1::StepRecord r;
      r.set_step(step);
      r.set_rank(rank);
      r.set_loss(1.0 / (step + 1));
      ASSERT_TRUE((*store)->PutStep(s->job.id(), r).ok());
    }
  }
  // A second attempt's record of the same step replaces the first.
  v1::StepRecord again;
  again.set_step(4);
  again.set_rank(1);
  again.set_attempt(1);
  ASSERT_TRUE((*store)->PutStep(s->job.id(), again).ok());

  std::vector<std::pair<int64_t, int32_t>> seen;
  std::string token;
  do {
    auto page = (*store)->Steps(s->job.id(), 2, 7, -1, 5, token);
    ASSERT_TRUE(page.ok()) << page.status();
    for (const v1::StepRecord& r : page->records) {
      seen.push_back({r.step(), r.rank()});
      if (r.step() == 4 && r.rank() == 1) {
        EXPECT_EQ(r.attempt(), 1);
      }
    }
    token = page->next_page_token;
  } while (!token.empty());
  ASSERT_EQ(seen.size(), 18u);  // steps 2..7, 3 ranks
  for (size_t i = 0; i < seen.size(); ++i) {
    EXPECT_EQ(seen[i], (std::pair<int64_t, int32_t>{2 + static_cast<int64_t>(i) / 3,
                                                     static_cast<int32_t>(i % 3)}));
  }
  auto rank2 = (*store)->Steps(s->job.id(), 0, -1, 2, 0, "");
  ASSERT_TRUE(rank2.ok());
  EXPECT_EQ(rank2->records.size(), 10u);
  for (const v1::StepRecord& r : rank2->records) EXPECT_EQ(r.rank(), 2);
}

// A deleted job goes with its events and step records, for good (a reopen
// does not bring it back); its request id is free; the others stay.
TEST(JobStoreTest, ADeletedJobGoesWithItsEventsAndStepsAndStaysGone) {
  const std::string db = FreshDb("delete");
  std::string kept, gone;
  {
    auto store = JobStore::Open(db);
    ASSERT_TRUE(store.ok()) << store.status();
    auto a = (*store)->Submit("req-a", Spec("a"), "", 1);
    auto b = (*store)->Submit("req-b", Spec("b"), "", 2);
    ASSERT_TRUE(a.ok() && b.ok());
    gone = a->job.id();
    kept = b->job.id();
    for (const std::string& id : {gone, kept}) {
      v1::StepRecord r;
      r.set_step(0);
      ASSERT_TRUE((*store)->PutStep(id, r).ok());
      v1::JobEvent e;
      e.mutable_state_change()->set_state(v1::JOB_STATE_SUCCEEDED);
      ASSERT_TRUE((*store)
                      ->Append(id, e, 100,
                               [](v1::Job& j) {
                                 j.set_state(v1::JOB_STATE_SUCCEEDED);
                                 j.set_finished_unix_ms(100);
                               })
                      .ok());
    }
    ASSERT_TRUE((*store)->Update(kept, [](v1::Job& j) { j.set_finished_unix_ms(500); }).ok());
    EXPECT_THAT((*store)->FinishedBefore(200), ::testing::ElementsAre(gone));
    EXPECT_THAT((*store)->FinishedBefore(1000), ::testing::ElementsAre(gone, kept));
    ASSERT_TRUE((*store)->Delete(gone).ok());
    EXPECT_EQ((*store)->Get(gone).status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ((*store)->Events(gone, 0, 10).status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ((*store)->Delete(gone).code(), absl::StatusCode::kNotFound);
    EXPECT_TRUE((*store)->Get(kept).ok());
  }
  auto store = JobStore::Open(db);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->Get(gone).status().code(), absl::StatusCode::kNotFound);
  auto steps = (*store)->Steps(kept, 0, -1, -1, 10, "");
  ASSERT_TRUE(steps.ok());
  EXPECT_EQ(steps->records.size(), 1u);
  EXPECT_EQ((*store)->Events(kept, 0, 10)->size(), 2u);
  // The request id makes a new job now.
  auto again = (*store)->Submit("req-a", Spec("a"), "", 3);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->created);
  EXPECT_NE(again->job.id(), gone);
  // No step or event row of the deleted job is left in the file.
  sqlite3* raw = nullptr;
  ASSERT_EQ(sqlite3_open(db.c_str(), &raw), SQLITE_OK);
  for (const char* sql : {"SELECT COUNT(*) FROM steps", "SELECT COUNT(*) FROM events"}) {
    sqlite3_stmt* q = nullptr;
    ASSERT_EQ(sqlite3_prepare_v2(raw, sql, -1, &q, nullptr), SQLITE_OK);
    ASSERT_EQ(sqlite3_step(q), SQLITE_ROW);
    // The kept job's step and its two events; the new job's first event.
    EXPECT_EQ(sqlite3_column_int(q, 0), std::string(sql).find("steps") != std::string::npos ? 1 : 3)
        << sql;
    sqlite3_finalize(q);
  }
  sqlite3_close(raw);
}

// The bounds on unfinished jobs: a client at its bound is refused (naming
// it) while another client is not; a job that ends frees its place; a
// request id seen before is answered at the bound; the counts are rebuilt
// from the file on reopen; the total bound holds over every client.
TEST(JobStoreTest, UnfinishedJobsAreBoundedPerClientAndInAll) {
  const std::string db = FreshDb("bounds");
  const auto finish = [](JobStore& store, const std::string& id) {
    v1::JobEvent done;
    done.mutable_state_change()->set_state(v1::JOB_STATE_SUCCEEDED);
    return store.Append(id, done, 3000, [](v1::Job& j) { j.set_state(v1::JOB_STATE_SUCCEEDED); })
        .ok();
  };
  std::string first;
  {
    auto store = JobStore::Open(db);
    ASSERT_TRUE(store.ok()) << store.status();
    (*store)->SetLimits({.unfinished = 5, .unfinished_per_client = 3});
    for (int i = 0; i < 3; ++i) {
      auto s = (*store)->Submit(absl::StrCat("a-", i), Spec("a"), "waiting", 1000, "ipv4:10.0.0.1");
      ASSERT_TRUE(s.ok()) << s.status();
      EXPECT_EQ(s->job.submitted_by(), "ipv4:10.0.0.1");
      if (i == 0) first = s->job.id();
    }
    auto refused = (*store)->Submit("a-3", Spec("a"), "waiting", 1000, "ipv4:10.0.0.1");
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(refused.status().message(), HasSubstr("client ipv4:10.0.0.1 has 3 unfinished"));
    // Nothing of the refused submit is kept: its request id is still free.
    EXPECT_EQ((*store)->UnfinishedCount(), 3);
    // The same request again is its job, bound or not.
    auto again = (*store)->Submit("a-0", Spec("a"), "waiting", 1000, "ipv4:10.0.0.1");
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_FALSE(again->created);
    EXPECT_TRUE((*store)->Submit("b-0", Spec("b"), "waiting", 1000, "ipv4:10.0.0.2").ok());
    ASSERT_TRUE(finish(**store, first));
    EXPECT_EQ((*store)->UnfinishedCountOf("ipv4:10.0.0.1"), 2);
    EXPECT_TRUE((*store)->Submit("a-3", Spec("a"), "waiting", 1000, "ipv4:10.0.0.1").ok());
  }
  auto store = JobStore::Open(db);
  ASSERT_TRUE(store.ok()) << store.status();
  (*store)->SetLimits({.unfinished = 5, .unfinished_per_client = 3});
  EXPECT_EQ((*store)->UnfinishedCount(), 4);
  EXPECT_EQ((*store)->UnfinishedCountOf("ipv4:10.0.0.1"), 3);
  EXPECT_EQ((*store)->Submit("a-4", Spec("a"), "waiting", 1000, "ipv4:10.0.0.1").status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE((*store)->Submit("c-0", Spec("c"), "waiting", 1000, "ipv4:10.0.0.3").ok());
  auto full = (*store)->Submit("d-0", Spec("d"), "waiting", 1000, "ipv4:10.0.0.4");
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.status().message(), HasSubstr("holds 5 unfinished jobs"));
  // A deleted job's place is free again (a finished one only is deleted by
  // the manager; the store counts what it removes either way).
  ASSERT_TRUE((*store)->Delete(first).ok());
  EXPECT_EQ((*store)->UnfinishedCount(), 5);
}

// One integer or blob length an SQL query over the state file answers.
int64_t QueryInt(const std::string& db, const std::string& sql) {
  sqlite3* raw = nullptr;
  EXPECT_EQ(sqlite3_open(db.c_str(), &raw), SQLITE_OK);
  sqlite3_stmt* q = nullptr;
  EXPECT_EQ(sqlite3_prepare_v2(raw, sql.c_str(), -1, &q, nullptr), SQLITE_OK) << sql;
  const int64_t out = sqlite3_step(q) == SQLITE_ROW ? sqlite3_column_int64(q, 0) : -1;
  sqlite3_finalize(q);
  sqlite3_close(raw);
  return out;
}

// A job's spec is stored once, at submit: the updates of its steps rewrite
// only the rest of its row (a 200 kB spec stays out of every step's write),
// and the spec comes back whole on reopen. The jobs' index is by seq, so
// deleting one job leaves every other job found by its id and request id.
TEST(JobStoreTest, TheSpecIsWrittenOnceAndStepUpdatesLeaveItOut) {
  const std::string db = FreshDb("spec_apart");
  v1::JobSpec big = Spec("big");
  big.set_device(std::string(200'000, 'x'));
  std::string id;
  {
    auto store = JobStore::Open(db);
    ASSERT_TRUE(store.ok()) << store.status();
    auto first = (*store)->Submit("req-0", Spec("small"), "", 1);
    auto s = (*store)->Submit("req-1", big, "", 1);
    auto last = (*store)->Submit("req-2", Spec("small"), "", 1);
    ASSERT_TRUE(first.ok() && s.ok() && last.ok());
    id = s->job.id();
    for (int step = 0; step < 20; ++step) {
      ASSERT_TRUE((*store)->Update(id, [&](v1::Job& j) { j.set_steps_done(step + 1); }).ok());
    }
    ASSERT_TRUE((*store)->Delete(first->job.id()).ok());
    auto after = (*store)->Get(last->job.id());
    ASSERT_TRUE(after.ok()) << after.status();
    EXPECT_EQ(after->request_id(), "req-2");
    auto by_request = (*store)->Submit("req-2", Spec("small"), "", 1);
    ASSERT_TRUE(by_request.ok());
    EXPECT_EQ(by_request->job.id(), last->job.id());
  }
  EXPECT_LT(QueryInt(db, "SELECT MAX(length(job)) FROM jobs"), 1000);
  EXPECT_GT(QueryInt(db, "SELECT length(spec) FROM specs WHERE seq = 2"), 200'000);
  auto store = JobStore::Open(db);
  ASSERT_TRUE(store.ok()) << store.status();
  auto job = (*store)->Get(id);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->spec().device(), big.device());
  EXPECT_EQ(job->steps_done(), 20);
}

// A state file of the first schema (the spec inside each job's blob) opens:
// its specs move to their own table, its jobs read as before, and the file
// says schema 2 from then on.
TEST(JobStoreTest, AStateFileOfTheFirstSchemaIsMovedOnOpen) {
  const std::string db = FreshDb("schema1");
  v1::Job old;
  old.set_id("j-7");
  old.set_request_id("req-7");
  old.set_state(v1::JOB_STATE_RUNNING);
  old.set_last_event_index(1);
  *old.mutable_spec() = Spec("old", 33);
  {
    sqlite3* raw = nullptr;
    ASSERT_EQ(sqlite3_open(db.c_str(), &raw), SQLITE_OK);
    const std::string blob = old.SerializeAsString();
    const std::string sql = absl::StrCat(
        "CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);"
        "INSERT INTO meta VALUES('schema', '1');"
        "CREATE TABLE jobs(seq INTEGER PRIMARY KEY, id TEXT UNIQUE NOT NULL,"
        "  request_id TEXT NOT NULL, job BLOB NOT NULL);"
        "INSERT INTO jobs VALUES(7, 'j-7', 'req-7', x'",
        absl::BytesToHexString(blob), "');");
    ASSERT_EQ(sqlite3_exec(raw, sql.c_str(), nullptr, nullptr, nullptr), SQLITE_OK)
        << sqlite3_errmsg(raw);
    sqlite3_close(raw);
  }
  {
    auto store = JobStore::Open(db);
    ASSERT_TRUE(store.ok()) << store.status();
    auto job = (*store)->Get("j-7");
    ASSERT_TRUE(job.ok()) << job.status();
    EXPECT_EQ(job->spec().name(), "old");
    EXPECT_EQ(job->spec().training().steps(), 33);
    auto next = (*store)->Submit("", Spec("new"), "", 1);
    ASSERT_TRUE(next.ok());
    EXPECT_EQ(next->job.id(), "j-8");
  }
  EXPECT_EQ(QueryInt(db, "SELECT COUNT(*) FROM specs"), 2);
  EXPECT_EQ(QueryInt(db, "SELECT CAST(value AS INTEGER) FROM meta WHERE key = 'schema'"), 2);
  v1::Job stored;
  {
    sqlite3* raw = nullptr;
    ASSERT_EQ(sqlite3_open(db.c_str(), &raw), SQLITE_OK);
    sqlite3_stmt* q = nullptr;
    ASSERT_EQ(sqlite3_prepare_v2(raw, "SELECT job FROM jobs WHERE seq = 7", -1, &q, nullptr),
              SQLITE_OK);
    ASSERT_EQ(sqlite3_step(q), SQLITE_ROW);
    ASSERT_TRUE(stored.ParseFromArray(sqlite3_column_blob(q, 0), sqlite3_column_bytes(q, 0)));
    sqlite3_finalize(q);
    sqlite3_close(raw);
  }
  EXPECT_FALSE(stored.has_spec());
  EXPECT_EQ(stored.id(), "j-7");
  auto again = JobStore::Open(db);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)->Get("j-7")->spec().name(), "old");
}

TEST(JobStoreTest, AFileThatIsNotADatabaseIsRefusedNamingIt) {
  const std::string db = FreshDb("garbage");
  std::ofstream(db) << "this is not sqlite, just text that goes on for a while............";
  auto store = JobStore::Open(db);
  EXPECT_EQ(store.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(store.status().message()), HasSubstr(db));
}

}  // namespace
}  // namespace muonmesh::coordinator
