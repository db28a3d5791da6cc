// attnctl session: the server's KV-cache sessions from the command line.
//
//   attnctl session create --layers=2 --heads=8 --kv_heads=2 --key_dim=64
//   attnctl session step ID --layer=0 --key=k.npy --value=v.npy --query=q.npy
//   attnctl session step ID --demo --tokens=1 --query_tokens=1
//   attnctl session fork ID [LENGTH]
//   attnctl session truncate ID LENGTH
//   attnctl session get ID
//   attnctl session delete ID
//   attnctl session [list]
//
// Each process is a new client, so `step` first asks the server for the
// session's lengths (Session::Attach) and sends the layer's length as the
// step's expected_length: attnctl is one more writer, not a tracker.
#ifndef ATTNSERVE_CLIENT_ATTNCTL_SESSIONS_H_
#define ATTNSERVE_CLIENT_ATTNCTL_SESSIONS_H_

#include <string>
#include <vector>

#include "attnserve/client/client.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

// One line describing a session, its id first:
// "ID layers=2 H=8 Hkv=2 Dk=64 Dv=64 dtype=FLOAT32 lengths=5,5
//  max_tokens=.. ttl=..s bytes=.. shared_bytes=.." and " forked_from=ID"
// for a fork.
std::string FormatSessionInfo(const v1::SessionInfo& info);

// Runs `attnctl session ARGS...`; returns the exit status.
int RunSession(Client& client, const std::vector<std::string>& args);

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_ATTNCTL_SESSIONS_H_
