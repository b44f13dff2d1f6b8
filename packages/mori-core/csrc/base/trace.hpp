// Timestamps of a small operation's steps across threads and processes, for finding where its
// latency goes (a device put+signal's: the proxy's pick-up and send, the target's handler, its
// GPU write, its answer). Off unless MORI_TRACE_DIR is set when a process marks its first step:
// then each process appends fixed records (CLOCK_MONOTONIC ns, the step's letter, an argument) to
// MORI_TRACE_DIR/mori-trace-<pid>.bin through a shared mapping, so a process that is killed keeps
// what it marked; the first kRecords records are kept. The clock is the host's, so the records
// of processes on one host (network namespaces included) line up. ci/trace_report.py reads them.
// Steps marked: see docs/core-ucx.md, "Timestamps".
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>

namespace mori::trace {

struct Record {
    uint64_t ns;    // CLOCK_MONOTONIC
    uint64_t step;  // a letter
    uint64_t arg;
};

inline constexpr size_t kRecords = size_t{1} << 18;

class File {
public:
    File() {
        const char* dir = std::getenv("MORI_TRACE_DIR");
        if (dir == nullptr || *dir == '\0') return;
        char path[4096];
        std::snprintf(path, sizeof(path), "%s/mori-trace-%d.bin", dir, static_cast<int>(getpid()));
        const int fd = ::open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd < 0) return;
        void* m = MAP_FAILED;
        if (ftruncate(fd, kRecords * sizeof(Record)) == 0)
            m = mmap(nullptr, kRecords * sizeof(Record), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        ::close(fd);
        if (m != MAP_FAILED) records_ = static_cast<Record*>(m);
    }
    void mark(char step, uint64_t arg) {
        if (records_ == nullptr) return;
        const size_t i = next_.fetch_add(1, std::memory_order_relaxed);
        if (i >= kRecords) return;
        timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        records_[i] = Record{static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000u + static_cast<uint64_t>(ts.tv_nsec),
                             static_cast<uint64_t>(step), arg};
    }

private:
    Record* records_ = nullptr;  // the mapping (kept until the process ends)
    std::atomic<size_t> next_{0};
};

// Marks a step of this process now (nothing unless MORI_TRACE_DIR was set at the first mark).
inline void mark(char step, uint64_t arg = 0) {
    static File file;
    file.mark(step, arg);
}

}  // namespace mori::trace
