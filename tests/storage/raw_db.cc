#include "tests/storage/raw_db.h"

#include <catch2/catch.hpp>
#include <rocksdb/options.h>

namespace rebound::testing {

RawDb::RawDb(const std::string& dir) {
  rocksdb::DBOptions options;
  std::vector<std::string> names;
  REQUIRE(rocksdb::DB::ListColumnFamilies(options, dir, &names).ok());
  std::vector<rocksdb::ColumnFamilyDescriptor> descriptors;
  for (const std::string& name : names) {
    descriptors.emplace_back(name, rocksdb::ColumnFamilyOptions());
  }
  rocksdb::DB* db = nullptr;
  const rocksdb::Status status = rocksdb::DB::Open(options, dir, descriptors, &handles_, &db);
  INFO(status.ToString());
  REQUIRE(status.ok());
  db_.reset(db);
  for (size_t i = 0; i < names.size(); ++i) by_name_[names[i]] = handles_[i];
}

RawDb::~RawDb() {
  for (rocksdb::ColumnFamilyHandle* handle : handles_) {
    db_->DestroyColumnFamilyHandle(handle).PermitUncheckedError();
  }
  db_->Close().PermitUncheckedError();
}

std::string RawDb::Get(const std::string& family, const std::string& key) {
  std::string value;
  const rocksdb::Status status = db_->Get(rocksdb::ReadOptions(), Family(family), key, &value);
  INFO(family << " " << key << ": " << status.ToString());
  REQUIRE(status.ok());
  return value;
}

void RawDb::Put(const std::string& family, const std::string& key, const std::string& value) {
  const rocksdb::Status status = db_->Put(rocksdb::WriteOptions(), Family(family), key, value);
  INFO(family << " " << key << ": " << status.ToString());
  REQUIRE(status.ok());
}

rocksdb::ColumnFamilyHandle* RawDb::Family(const std::string& name) {
  INFO("column family " << name);
  REQUIRE(by_name_.count(name) == 1);
  return by_name_[name];
}

std::set<std::string> RawDb::names() const {
  std::set<std::string> names;
  for (const auto& [name, handle] : by_name_) names.insert(name);
  return names;
}

}  // namespace rebound::testing
