// Names for mori's own threads, as `top -H`, `ps -L` and /proc/PID/task/TID/comm show them: a
// data plane's sender, receiver and server threads, told apart from the application's.
#pragma once

#include <pthread.h>

namespace mori {

// Names the calling thread (at most 15 characters are kept).
inline void name_this_thread(const char* name) { pthread_setname_np(pthread_self(), name); }

}  // namespace mori
