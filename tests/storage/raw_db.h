#pragma once

// A raw RocksDB handle on a closed store's data directory, every column family open, for tests
// that damage stored values the way a disk would (storage/durable_store_test, the bad-input
// matrix). Failures are Catch2 REQUIREs: the caller's test fails with RocksDB's message.

#include <rocksdb/db.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace rebound::testing {

class RawDb {
 public:
  explicit RawDb(const std::string& dir);
  ~RawDb();

  RawDb(const RawDb&) = delete;
  RawDb& operator=(const RawDb&) = delete;

  std::string Get(const std::string& family, const std::string& key);
  void Put(const std::string& family, const std::string& key, const std::string& value);

  rocksdb::ColumnFamilyHandle* Family(const std::string& name);
  rocksdb::DB* db() { return db_.get(); }
  // The column families' names.
  std::set<std::string> names() const;

 private:
  std::unique_ptr<rocksdb::DB> db_;
  std::vector<rocksdb::ColumnFamilyHandle*> handles_;
  std::map<std::string, rocksdb::ColumnFamilyHandle*> by_name_;
};

}  // namespace rebound::testing
