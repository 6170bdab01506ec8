// coord/etcd_client against real etcd members (testing/etcd): KV round trips and revisions, the
// election Txn, leases (revoke, expiry, a LeaseKeeper), watches, failover to another member of
// a 3-member cluster without losing or repeating a watch event, and UNAVAILABLE with every
// member down. Fails (never skips) when /usr/bin/etcd is missing.

#include "coord/etcd_client.h"

#include <catch2/catch.hpp>

#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "testing/etcd/etcd_process.h"

namespace rebound {
namespace {

using ::rebound::testing::EtcdCluster;
using ::rebound::testing::EtcdClusterOptions;

std::unique_ptr<EtcdCluster> StartEtcd(int members) {
  EtcdClusterOptions options;
  options.members = members;
  absl::StatusOr<std::unique_ptr<EtcdCluster>> cluster = EtcdCluster::Start(options);
  INFO("starting " << members << " etcd member(s): " << cluster.status()
                   << " (etcd comes from Debian's etcd-server: run tools/setup.sh)");
  REQUIRE(cluster.ok());
  return std::move(*cluster);
}

EtcdClientOptions Options(const std::vector<std::string>& endpoints) {
  EtcdClientOptions options;
  options.endpoints = endpoints;
  options.call_deadline = absl::Seconds(1);
  options.retry.initial_backoff = absl::Milliseconds(20);
  options.retry.max_backoff = absl::Milliseconds(200);
  options.retry.give_up_after = absl::Seconds(5);
  return options;
}

std::unique_ptr<EtcdClient> Connect(const std::vector<std::string>& endpoints) {
  absl::StatusOr<std::unique_ptr<EtcdClient>> client = EtcdClient::Create(Options(endpoints));
  REQUIRE(client.ok());
  return std::move(*client);
}

// Polls `done` every 50 ms until it holds or `timeout` passes; whether it held.
bool WaitUntil(absl::Duration timeout, const std::function<bool()>& done) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return done();
}

bool Exists(EtcdClient& client, const std::string& key) {
  absl::StatusOr<std::optional<EtcdValue>> value = client.Get(key);
  REQUIRE(value.ok());
  return value->has_value();
}

// The events a Watcher delivered, for the test thread to read.
class EventLog {
 public:
  std::function<void(const EtcdEvent&)> Callback() {
    return [this](const EtcdEvent& event) {
      absl::MutexLock lock(&mu_);
      events_.push_back(event);
    };
  }
  std::vector<EtcdEvent> events() const {
    absl::MutexLock lock(&mu_);
    return events_;
  }
  size_t size() const {
    absl::MutexLock lock(&mu_);
    return events_.size();
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<EtcdEvent> events_;
};

// The (type, key, revision) of each event, for comparing two watches.
std::vector<std::string> Describe(const std::vector<EtcdEvent>& events) {
  std::vector<std::string> out;
  for (const EtcdEvent& e : events) {
    out.push_back(absl::StrCat(e.type == EtcdEvent::Type::kPut ? "PUT " : "DELETE ", e.key, "=",
                               e.value, " @", e.mod_revision));
  }
  return out;
}

// Checks that `live` (a watch that went through a failover) delivered exactly etcd's history of
// `prefix` since `from_revision`: a fresh watch replaying it from there sees the same events,
// so none was lost or repeated. (A write retried after a timeout may legitimately have been
// applied twice, at two revisions: both are in the history.)
void CheckSameAsHistory(EtcdClient& client, const std::string& prefix, int64_t from_revision,
                        const EventLog& live) {
  EventLog replay;
  absl::StatusOr<std::unique_ptr<Watcher>> watcher =
      client.Watch(WatchSpec{prefix, true, from_revision}, replay.Callback());
  REQUIRE(watcher.ok());
  const size_t expected = live.size();
  REQUIRE(WaitUntil(absl::Seconds(5), [&] { return replay.size() >= expected; }));
  absl::SleepFor(absl::Milliseconds(200));
  CHECK(Describe(live.events()) == Describe(replay.events()));
}

TEST_CASE("Put, Get and Delete round trip with increasing revisions", "[etcd]") {
  auto etcd = StartEtcd(1);
  auto client = Connect(etcd->client_endpoints());

  absl::StatusOr<std::optional<EtcdValue>> missing = client->Get("/t/a");
  REQUIRE(missing.ok());
  CHECK(!missing->has_value());

  absl::StatusOr<int64_t> first = client->Put("/t/a", "one");
  REQUIRE(first.ok());
  absl::StatusOr<std::optional<EtcdValue>> got = client->Get("/t/a");
  REQUIRE(got.ok());
  REQUIRE(got->has_value());
  CHECK((*got)->value == "one");
  CHECK((*got)->mod_revision == *first);
  CHECK((*got)->create_revision == *first);
  CHECK((*got)->lease_id == 0);

  absl::StatusOr<int64_t> second = client->Put("/t/a", std::string("tw\0o", 4));
  REQUIRE(second.ok());
  CHECK(*second > *first);
  got = client->Get("/t/a");
  REQUIRE(got.ok());
  REQUIRE(got->has_value());
  CHECK((*got)->value == std::string("tw\0o", 4));
  CHECK((*got)->mod_revision == *second);
  CHECK((*got)->create_revision == *first);

  absl::StatusOr<int64_t> deleted = client->Delete("/t/a");
  REQUIRE(deleted.ok());
  CHECK(*deleted > *second);
  CHECK(!Exists(*client, "/t/a"));

  CHECK(client->Get("").status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(client->Put("", "x").status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(EtcdClient::Create(EtcdClientOptions()).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(client->Watch(WatchSpec{"", true, 0}, [](const EtcdEvent&) {}).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(client->KeepAlive(EtcdLease{0, absl::Seconds(5)}).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(client->GrantLease(absl::ZeroDuration()).status().code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("Without the etcd binary the harness fails, naming tools/setup.sh", "[etcd]") {
  EtcdClusterOptions options;
  options.etcd_binary = "/nonexistent/etcd";
  absl::StatusOr<std::unique_ptr<EtcdCluster>> cluster = EtcdCluster::Start(options);
  CHECK(cluster.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(cluster.status().message().find("tools/setup.sh") != std::string::npos);
}

TEST_CASE("PutIfAbsent succeeds once; the second caller gets the first value", "[etcd]") {
  auto etcd = StartEtcd(1);
  auto alice = Connect(etcd->client_endpoints());
  auto bob = Connect(etcd->client_endpoints());

  absl::StatusOr<EtcdLease> lease = alice->GrantLease(absl::Seconds(10));
  REQUIRE(lease.ok());
  absl::StatusOr<PutIfAbsentResult> won = alice->PutIfAbsent("/t/leader", "alice:1", lease->id);
  REQUIRE(won.ok());
  CHECK(won->succeeded);
  CHECK(!won->existing.has_value());

  absl::StatusOr<PutIfAbsentResult> lost = bob->PutIfAbsent("/t/leader", "bob:2", 0);
  REQUIRE(lost.ok());
  CHECK(!lost->succeeded);
  CHECK(lost->revision >= won->revision);
  REQUIRE(lost->existing.has_value());
  CHECK(lost->existing->value == "alice:1");
  CHECK(lost->existing->create_revision == won->revision);  // the winner's epoch
  CHECK(lost->existing->lease_id == lease->id);

  // The key kept alice's value.
  absl::StatusOr<std::optional<EtcdValue>> value = bob->Get("/t/leader");
  REQUIRE(value.ok());
  REQUIRE(value->has_value());
  CHECK((*value)->value == "alice:1");
  CHECK((*value)->mod_revision == won->revision);

  // CompareAndPut: only with the current mod revision.
  absl::StatusOr<CompareAndPutResult> stale = bob->CompareAndPut("/t/leader", won->revision - 1, "x");
  REQUIRE(stale.ok());
  CHECK(!stale->succeeded);
  absl::StatusOr<CompareAndPutResult> fresh = bob->CompareAndPut("/t/leader", won->revision, "y");
  REQUIRE(fresh.ok());
  CHECK(fresh->succeeded);
  value = alice->Get("/t/leader");
  REQUIRE(value.ok());
  REQUIRE(value->has_value());
  CHECK((*value)->value == "y");
  CHECK((*value)->mod_revision == fresh->revision);
  // Expected 0: only if the key does not exist.
  absl::StatusOr<CompareAndPutResult> create = bob->CompareAndPut("/t/new", 0, "z");
  REQUIRE(create.ok());
  CHECK(create->succeeded);
  create = bob->CompareAndPut("/t/new", 0, "z2");
  REQUIRE(create.ok());
  CHECK(!create->succeeded);
}

TEST_CASE("A key bound to a lease goes with a revoke, and with an expiry", "[etcd]") {
  auto etcd = StartEtcd(1);
  auto client = Connect(etcd->client_endpoints());

  absl::StatusOr<EtcdLease> lease = client->GrantLease(absl::Seconds(30));
  REQUIRE(lease.ok());
  CHECK(lease->ttl == absl::Seconds(30));
  REQUIRE(client->Put("/t/revoked", "v", lease->id).ok());
  CHECK(Exists(*client, "/t/revoked"));
  REQUIRE(client->RevokeLease(lease->id).ok());
  CHECK(!Exists(*client, "/t/revoked"));
  // The lease is gone: binding to it or revoking it again is FAILED_PRECONDITION.
  CHECK(client->Put("/t/revoked", "v", lease->id).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  CHECK(client->PutIfAbsent("/t/revoked", "v", lease->id).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  CHECK(client->RevokeLease(lease->id).code() == absl::StatusCode::kFailedPrecondition);

  absl::StatusOr<EtcdLease> short_lease = client->GrantLease(absl::Seconds(1));
  REQUIRE(short_lease.ok());
  REQUIRE(short_lease->ttl >= absl::Seconds(1));
  const absl::Time put_at = absl::Now();
  REQUIRE(client->Put("/t/expires", "v", short_lease->id).ok());
  CHECK(WaitUntil(short_lease->ttl + absl::Seconds(3), [&] { return !Exists(*client, "/t/expires"); }));
  // Not before its TTL (etcd may expire it a little after, never before).
  CHECK(absl::Now() - put_at >= short_lease->ttl - absl::Milliseconds(100));
}

TEST_CASE("A LeaseKeeper keeps a 2 s lease alive; after Stop the key goes", "[etcd]") {
  auto etcd = StartEtcd(1);
  auto client = Connect(etcd->client_endpoints());
  absl::StatusOr<EtcdLease> lease = client->GrantLease(absl::Seconds(2));
  REQUIRE(lease.ok());
  REQUIRE(lease->ttl == absl::Seconds(2));
  REQUIRE(client->Put("/t/kept", "v", lease->id).ok());

  absl::StatusOr<std::unique_ptr<LeaseKeeper>> keeper = client->KeepAlive(*lease);
  REQUIRE(keeper.ok());
  const absl::Time until = absl::Now() + absl::Seconds(5);
  absl::Duration worst_staleness;
  while (absl::Now() < until) {
    REQUIRE(Exists(*client, "/t/kept"));
    worst_staleness = std::max(worst_staleness, absl::Now() - (*keeper)->last_renewed());
    absl::SleepFor(absl::Milliseconds(200));
  }
  CHECK((*keeper)->status().ok());
  CHECK((*keeper)->ttl() == absl::Seconds(2));
  CHECK((*keeper)->renewals() >= 6);  // every ttl/3 for 5 s
  // Self-fencing would never have triggered: renewed within TTL/2 all along.
  CHECK(worst_staleness < absl::Seconds(1));

  (*keeper)->Stop();
  CHECK((*keeper)->status().code() == absl::StatusCode::kCancelled);
  const absl::Time stopped = absl::Now();
  CHECK(WaitUntil(absl::Seconds(2) + absl::Seconds(2), [&] { return !Exists(*client, "/t/kept"); }));
  CHECK(absl::Now() - stopped < absl::Seconds(4));

  // A keeper of a lease that is gone ends with FAILED_PRECONDITION.
  absl::StatusOr<EtcdLease> doomed = client->GrantLease(absl::Seconds(5));
  REQUIRE(doomed.ok());
  REQUIRE(client->RevokeLease(doomed->id).ok());
  absl::StatusOr<std::unique_ptr<LeaseKeeper>> lost = client->KeepAlive(*doomed);
  REQUIRE(lost.ok());
  CHECK(WaitUntil(absl::Seconds(5), [&] { return !(*lost)->status().ok(); }));
  CHECK((*lost)->status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK((*lost)->renewals() == 0);
}

TEST_CASE("Watch sees puts and deletes in order with their revisions", "[etcd]") {
  auto etcd = StartEtcd(1);
  auto client = Connect(etcd->client_endpoints());
  absl::StatusOr<int64_t> before = client->Put("/w/a", "old");  // before the watch: not seen
  REQUIRE(before.ok());

  EventLog log;
  absl::StatusOr<std::unique_ptr<Watcher>> watcher =
      client->Watch(WatchSpec{"/w/", /*prefix=*/true, /*start_revision=*/0}, log.Callback());
  REQUIRE(watcher.ok());
  REQUIRE(WaitUntil(absl::Seconds(5), [&] { return (*watcher)->streams() == 1; }));

  absl::StatusOr<int64_t> put = client->Put("/w/a", "new");
  REQUIRE(put.ok());
  REQUIRE(client->Put("/x/outside", "not watched").ok());
  absl::StatusOr<int64_t> deleted = client->Delete("/w/a");
  REQUIRE(deleted.ok());
  REQUIRE(WaitUntil(absl::Seconds(5), [&] { return log.size() >= 2; }));
  absl::SleepFor(absl::Milliseconds(200));  // nothing more may come
  std::vector<EtcdEvent> events = log.events();
  REQUIRE(events.size() == 2);
  CHECK(events[0].type == EtcdEvent::Type::kPut);
  CHECK(events[0].key == "/w/a");
  CHECK(events[0].value == "new");
  CHECK(events[0].mod_revision == *put);
  CHECK(events[0].create_revision == *before);
  CHECK(events[1].type == EtcdEvent::Type::kDelete);
  CHECK(events[1].key == "/w/a");
  CHECK(events[1].mod_revision == *deleted);
  CHECK((*watcher)->last_revision() == *deleted);

  // A watch from a past revision replays history from there.
  EventLog replay;
  absl::StatusOr<std::unique_ptr<Watcher>> from_past =
      client->Watch(WatchSpec{"/w/a", false, *before}, replay.Callback());
  REQUIRE(from_past.ok());
  REQUIRE(WaitUntil(absl::Seconds(5), [&] { return replay.size() >= 3; }));
  std::vector<EtcdEvent> replayed = replay.events();
  REQUIRE(replayed.size() == 3);
  CHECK(replayed[0].mod_revision == *before);
  CHECK(replayed[0].value == "old");
  CHECK(replayed[1].mod_revision == *put);
  CHECK(replayed[2].mod_revision == *deleted);

  (*watcher)->Cancel();
  CHECK((*watcher)->status().code() == absl::StatusCode::kCancelled);
  REQUIRE(client->Put("/w/b", "after cancel").ok());
  absl::SleepFor(absl::Milliseconds(200));
  CHECK(log.size() == 2);
}

TEST_CASE("After the member in use is killed, KV, leases and the watch go on elsewhere",
          "[etcd]") {
  auto etcd = StartEtcd(3);
  auto client = Connect(etcd->client_endpoints());
  EventLog log;
  absl::StatusOr<std::unique_ptr<Watcher>> watcher =
      client->Watch(WatchSpec{"/f/", true, 0}, log.Callback());
  REQUIRE(watcher.ok());
  REQUIRE(WaitUntil(absl::Seconds(5), [&] { return (*watcher)->streams() == 1; }));
  absl::StatusOr<EtcdLease> lease = client->GrantLease(absl::Seconds(2));
  REQUIRE(lease.ok());
  absl::StatusOr<std::unique_ptr<LeaseKeeper>> keeper = client->KeepAlive(*lease);
  REQUIRE(keeper.ok());
  REQUIRE(client->Put("/f/leased", "v", lease->id).ok());

  std::vector<int64_t> revisions;
  for (int k = 0; k < 5; ++k) {
    absl::StatusOr<int64_t> revision = client->Put(absl::StrCat("/f/", k), absl::StrCat(k));
    REQUIRE(revision.ok());
    revisions.push_back(*revision);
  }
  const std::string used = client->current_endpoint();
  int killed = -1;
  for (int i = 0; i < etcd->size(); ++i) {
    if (etcd->client_endpoint(i) == used) killed = i;
  }
  REQUIRE(killed >= 0);
  etcd->Kill(killed);

  for (int k = 5; k < 10; ++k) {
    absl::StatusOr<int64_t> revision = client->Put(absl::StrCat("/f/", k), absl::StrCat(k));
    INFO(revision.status());
    REQUIRE(revision.ok());
    revisions.push_back(*revision);
  }
  CHECK(client->current_endpoint() != used);
  absl::StatusOr<std::optional<EtcdValue>> value = client->Get("/f/9");
  REQUIRE(value.ok());
  REQUIRE(value->has_value());
  CHECK((*value)->value == "9");

  // The watch came back on another member and delivered every put once, in order (the leased
  // put came first), each at the revision its Put returned.
  REQUIRE(WaitUntil(absl::Seconds(10), [&] {
    return !log.events().empty() && log.events().back().key == "/f/9";
  }));
  absl::SleepFor(absl::Milliseconds(300));
  std::vector<EtcdEvent> events = log.events();
  REQUIRE(events.size() >= 11);
  CHECK(events[0].key == "/f/leased");
  for (int k = 0; k < 10; ++k) {
    int found = 0;
    for (const EtcdEvent& event : events) {
      found += event.key == absl::StrCat("/f/", k) && event.mod_revision == revisions[k] ? 1 : 0;
    }
    CHECK(found == 1);
  }
  CheckSameAsHistory(*client, "/f/", events[0].mod_revision, log);
  CHECK((*watcher)->streams() >= 2);
  CHECK((*watcher)->status().ok());

  // The lease outlived the kill: kept alive through another member.
  absl::SleepFor(absl::Seconds(3));
  CHECK((*keeper)->status().ok());
  CHECK(absl::Now() - (*keeper)->last_renewed() < absl::Seconds(1));
  CHECK(Exists(*client, "/f/leased"));
}

TEST_CASE("A hung (SIGSTOPped) member in use: KV, the lease and the watch move on", "[etcd]") {
  auto etcd = StartEtcd(3);
  auto client = Connect(etcd->client_endpoints());
  EventLog log;
  absl::StatusOr<std::unique_ptr<Watcher>> watcher =
      client->Watch(WatchSpec{"/h/", true, 0}, log.Callback());
  REQUIRE(watcher.ok());
  REQUIRE(WaitUntil(absl::Seconds(5), [&] { return (*watcher)->streams() == 1; }));
  absl::StatusOr<EtcdLease> lease = client->GrantLease(absl::Seconds(2));
  REQUIRE(lease.ok());
  absl::StatusOr<std::unique_ptr<LeaseKeeper>> keeper = client->KeepAlive(*lease);
  REQUIRE(keeper.ok());
  REQUIRE(client->Put("/h/leased", "v", lease->id).ok());

  const std::string used = client->current_endpoint();
  int paused = -1;
  for (int i = 0; i < etcd->size(); ++i) {
    if (etcd->client_endpoint(i) == used) paused = i;
  }
  REQUIRE(paused >= 0);
  etcd->Pause(paused);
  const absl::Time paused_at = absl::Now();

  absl::StatusOr<int64_t> put = client->Put("/h/after", "x");
  INFO(put.status());
  REQUIRE(put.ok());
  CHECK(client->current_endpoint() != used);
  // The watch notices the hung stream by gRPC keepalive (6 s pings, 2 s timeout) and resumes
  // elsewhere with the put it missed.
  REQUIRE(WaitUntil(absl::Seconds(15), [&] {
    return !log.events().empty() && log.events().back().mod_revision == *put;
  }));
  std::vector<EtcdEvent> events = log.events();
  REQUIRE(events.size() >= 2);  // 3 when the timed-out first attempt of the Put was applied
  CHECK(events[0].key == "/h/leased");
  CHECK(events.back().key == "/h/after");
  CheckSameAsHistory(*client, "/h/", events[0].mod_revision, log);
  // The lease outlived the hang (renewed through another member).
  CHECK((*keeper)->status().ok());
  CHECK((*keeper)->last_renewed() > paused_at);
  CHECK(absl::Now() - (*keeper)->last_renewed() < absl::Seconds(1));
  CHECK(Exists(*client, "/h/leased"));
  etcd->Resume(paused);
}

TEST_CASE("With every member down a call is UNAVAILABLE within the retry bound; then it recovers", "[etcd]") {
  auto etcd = StartEtcd(3);
  EtcdClientOptions options = Options(etcd->client_endpoints());
  options.retry.give_up_after = absl::Seconds(2);
  options.retry.log_retries = false;
  absl::StatusOr<std::unique_ptr<EtcdClient>> client = EtcdClient::Create(options);
  REQUIRE(client.ok());
  REQUIRE((*client)->Put("/d/a", "v").ok());
  for (int i = 0; i < etcd->size(); ++i) etcd->Kill(i);

  const absl::Time start = absl::Now();
  absl::StatusOr<int64_t> put = (*client)->Put("/d/a", "w");
  const absl::Duration took = absl::Now() - start;
  CHECK(put.status().code() == absl::StatusCode::kUnavailable);
  CHECK(put.status().message().find("Put /d/a") != std::string::npos);
  CHECK(put.status().message().find("127.0.0.1:") != std::string::npos);
  // give_up_after, plus at most one attempt's deadline and one backoff.
  CHECK(took >= absl::Seconds(2));
  CHECK(took < absl::Seconds(2) + options.call_deadline + options.retry.max_backoff +
                   absl::Milliseconds(500));
  CHECK((*client)->Get("/d/a").status().code() == absl::StatusCode::kUnavailable);

  // etcd comes back (same ports, same data): the same client's calls succeed again, and the
  // value written before the outage is there.
  for (int i = 0; i < etcd->size(); ++i) REQUIRE(etcd->Restart(i).ok());
  const absl::Time back = absl::Now();
  absl::StatusOr<std::optional<EtcdValue>> value = (*client)->Get("/d/a");
  INFO(value.status());
  REQUIRE(value.ok());
  REQUIRE(value->has_value());
  CHECK((*value)->value == "v");
  CHECK(absl::Now() - back < absl::Seconds(3));
}

}  // namespace
}  // namespace rebound
