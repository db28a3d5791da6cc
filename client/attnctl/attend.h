// attnctl attend and attnctl mha: one Attend or MultiHeadAttention call with
// inputs from .npy files (or --demo), results printed and written to .npy
// files (--output, --weights_out, --lse_out) in the response's dtypes.
#ifndef ATTNSERVE_CLIENT_ATTNCTL_ATTEND_H_
#define ATTNSERVE_CLIENT_ATTNCTL_ATTEND_H_

#include "attnserve/client/client.h"

namespace attnserve {

// Runs `attnctl attend`; returns the exit status.
int RunAttend(Client& client);

// Runs `attnctl mha`; returns the exit status.
int RunMultiHead(Client& client);

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_ATTNCTL_ATTEND_H_
