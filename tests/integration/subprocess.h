#pragma once

// TEMPORARY forwarding header: the integration tests' process helpers moved to the testing/cluster
// library (testing/cluster/processes.h). Kept only for the tests outside tests/integration that
// still include this path (tests/storage/durable_store_test.cc); once they include
// testing/cluster/processes.h and depend on //testing/cluster:processes, delete this file and
// its target.

#include "testing/cluster/processes.h"
