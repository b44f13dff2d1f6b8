// Loading UCX at run time: libucs, libuct and libucp opened with dlopen from one directory and
// their functions resolved with dlsym (ucx/api.hpp). Once per process: a process holds one UCX.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ucx/api.hpp"

namespace mori::ucx {

// No candidate could be loaded; the message lists each one tried and why it failed.
class LoadError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

// A UCX call failed; the message names the call and UCX's words for the status.
class UcxError : public std::runtime_error {
public:
    UcxError(const std::string& what, api::Status status);
    api::Status status() const { return status_; }

private:
    api::Status status_;
};

struct Library {
    std::string path;    // the libucp that was opened
    std::string source;  // why it was chosen (the candidate's label)
    unsigned major = 0, minor = 0, release = 0;
};

// A library to try: the path of a libucp.so (its libucs/libuct are taken from the same folder)
// and a label saying where it came from ("MORI_UCX_LIB", "system UCX with verbs", ...).
struct Candidate {
    std::string libucp;
    std::string source;
};

// Loads the first candidate that opens and has every function mori needs. When a UCX is already
// loaded in this process (by mori or anyone else) that one is used instead, except that a
// candidate labelled "MORI_UCX_LIB" naming another file is an error. Throws LoadError.
const Library& load(const std::vector<Candidate>& candidates);
// The loaded library; throws LoadError when load() has not succeeded yet.
const Library& library();
const api::Functions& fn();
std::string status_text(api::Status s);
void check(const std::string& what, api::Status s);

// UCX's components (uct_query_components) with the memory domains (devices) each one found,
// e.g. {"tcp", {"tcp"}}, {"ib", {"mlx5_0"}}, {"ib", {}} where verbs is built in but no NIC exists.
std::vector<std::pair<std::string, std::vector<std::string>>> components();

// What a UCX call prints into a FILE (ucp_context_print_info, ucp_ep_print_info) as a string.
template <typename Fn>
std::string print_to_string(Fn&& fn);

}  // namespace mori::ucx

#include <cstdio>
#include <cstdlib>

template <typename Fn>
std::string mori::ucx::print_to_string(Fn&& fn) {
    char* buf = nullptr;
    size_t len = 0;
    FILE* f = open_memstream(&buf, &len);
    if (f == nullptr) return "";
    fn(f);
    std::fclose(f);
    std::string out(buf ? buf : "", len);
    std::free(buf);
    return out;
}
