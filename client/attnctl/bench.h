// attnctl bench: a closed-loop load generator, like ghz or perf_analyzer.
// --concurrency workers (threads) each make one synchronous call at a time on
// a shared Client, first for --warmup (not counted), then until --duration
// has passed or --requests calls have been made in all; the report gives
// throughput, GFLOP/s, latency percentiles and the errors by status code, as
// text or (--json) one JSON object.
#ifndef ATTNSERVE_CLIENT_ATTNCTL_BENCH_H_
#define ATTNSERVE_CLIENT_ATTNCTL_BENCH_H_

#include "attnserve/client/client.h"

namespace attnserve {

// Runs `attnctl bench`; returns the exit status: 0 if any call succeeded, 1
// if none did, 2 for a usage error.
int RunBench(Client& client);

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_ATTNCTL_BENCH_H_
