#include "common/grpc_polling.h"

#include <stdlib.h>

#include <string>

namespace rebound {

void ShortenGrpcBackupPolling() {
  // overwrite = 0: keeps an operator's value.
  setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS",
         std::to_string(kGrpcBackupPollIntervalMs).c_str(), 0);
}

}  // namespace rebound
