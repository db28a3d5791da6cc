// What the transport takes from a client: message sizes, streams, resets,
// compression, how long a message may take to arrive, and the threads that
// poll gRPC.
#ifndef ATTNSERVE_SERVER_RPC_TRANSPORT_OPTIONS_H_
#define ATTNSERVE_SERVER_RPC_TRANSPORT_OPTIONS_H_

#include <cstdint>

#include "absl/time/time.h"
#include "grpc/compression.h"

namespace attnserve {

struct TransportOptions {
  // The largest request or response message, in bytes; at most 2^31 - 1
  // (gRPC's limit). A response that would be larger is refused with
  // RESOURCE_EXHAUSTED before it is computed.
  int64_t max_message_bytes = int64_t{64} << 20;
  // HTTP/2 streams one connection may have open at once (SETTINGS
  // MAX_CONCURRENT_STREAMS; gRPC 1.51 advertises no limit by default). A
  // client past it waits for a stream to end.
  int max_concurrent_streams = 256;
  // Calls one connection's client may cancel in one second before the server
  // shuts the connection down (the rapid-reset mitigation gRPC 1.51 lacks:
  // HEADERS + RST_STREAM floods cost the server a call each and the client
  // nothing). Calls whose deadline passed do not count. 0: no limit.
  int max_client_resets_per_second = 200;
  // Whether requests compressed with gzip or deflate are taken. Off: they get
  // UNIMPLEMENTED before anything is inflated. On: gRPC's decompression is
  // turned off (gRPC 1.51 inflates a whole message before it applies
  // max_message_bytes) and the handlers inflate with a bound (inflate.h).
  bool accept_compressed_requests = false;
  // How responses are compressed, for clients that accept it (their
  // grpc-accept-encoding names it; others get them plain): GRPC_COMPRESS_NONE,
  // GRPC_COMPRESS_GZIP or GRPC_COMPRESS_DEFLATE. Compression costs CPU and
  // saves little on dense float tensors (BENCHMARKS.md).
  grpc_compression_algorithm response_compression = GRPC_COMPRESS_NONE;
  // How long a unary call's request may take to arrive after its headers, and
  // its answer (a second more per MiB) to be taken by the client once sent;
  // past it the call is cancelled, so a client that stops sending or reading
  // cannot make the server hold a message.
  absl::Duration message_timeout = absl::Seconds(30);
  // How long an AttendStream may wait for its next whole message while a read
  // is pending (its answers all written or being written), and for an answer
  // (a second more per MiB) to be taken; past it the stream is cancelled, so
  // an idle, stalled or unread stream cannot be held open forever.
  absl::Duration stream_idle_timeout = absl::Minutes(5);
  // How long a connection with no call open may stay before the server ends
  // it with a GOAWAY (gRPC's max_connection_idle; a client's next call opens
  // another, unseen by its caller): connections a client abandoned, or whose
  // peer vanished without closing (the transport's keepalive first looks
  // after two hours), give their descriptor and buffers back. Zero: never.
  absl::Duration max_connection_idle = absl::Minutes(10);
  // How long a new connection may take to finish its TLS handshake and send
  // HTTP/2's preface and SETTINGS (gRPC's server handshake timeout, 120 s by
  // default); past it the server closes it, so that connections which never
  // start (a slowloris flood) give their place under max_connections back.
  absl::Duration handshake_timeout = absl::Seconds(10);
  // Threads that poll gRPC and run the handlers (parse, validate, serialise,
  // and calls too small to hand to an executor). 0: one per 8 of the cores the
  // executors compute on, at least 1, at most 8. Each thread past the first
  // hands the poller over on every call (about 2.7 context switches a call
  // each, measured on 2 cores), so more only help when many large requests
  // arrive at once.
  int io_threads = 0;
  // How long the first io thread keeps polling without sleeping after each
  // event, while events come that close together, so that a client's next
  // call is taken without waking a thread (on the 2-vCPU VM measured, the
  // wake-up added ~55 µs to a tiny call's ~180 µs). Costs up to one core while
  // calls keep coming (attnserve_io_spin_seconds_total); zero never spins.
  absl::Duration io_spin = absl::Microseconds(200);
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_RPC_TRANSPORT_OPTIONS_H_
