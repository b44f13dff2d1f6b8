// Opens UCX with dlopen and resolves its functions (see ucx/lib.hpp).
#include "ucx/lib.hpp"

#include <dlfcn.h>
#include <link.h>
#include <sys/stat.h>

#include <cstring>
#include <mutex>

namespace mori::ucx {

namespace {

std::mutex loadMu;
bool loadedOk = false;
Library lib;
api::Functions table;

std::string folder_of(const std::string& path) {
    auto slash = path.rfind('/');
    return slash == std::string::npos ? "." : path.substr(0, slash);
}

bool same_file(const std::string& a, const std::string& b) {
    struct stat sa{}, sb{};
    return stat(a.c_str(), &sa) == 0 && stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

// The file a loaded library came from ("" if unknown).
std::string path_of(void* handle) {
    struct link_map* map = nullptr;
    if (dlinfo(handle, RTLD_DI_LINKMAP, &map) != 0 || map == nullptr || map->l_name == nullptr) return "";
    return map->l_name;
}

// A sibling of libucp in its folder: prefer the versioned soname, as the loader would.
std::string sibling(const std::string& dir, const char* stem) {
    for (const char* suffix : {".so.0", ".so"}) {
        std::string p = dir + "/" + stem + suffix;
        struct stat st{};
        if (stat(p.c_str(), &st) == 0) return p;
    }
    return dir + "/" + stem + ".so.0";
}

template <typename T>
void resolve(void* handle, const char* name, T& slot, std::string& missing) {
    slot = reinterpret_cast<T>(dlsym(handle, name));
    if (slot == nullptr) missing += std::string(missing.empty() ? "" : ", ") + name;
}

// Resolves every function; "" or the names that are missing.
std::string resolve_all(void* ucs, void* uct, void* ucp, api::Functions& f) {
    std::string m;
    resolve(ucs, "ucs_status_string", f.status_string, m);
    resolve(uct, "uct_query_components", f.query_components, m);
    resolve(uct, "uct_component_query", f.component_query, m);
    resolve(uct, "uct_release_component_list", f.release_component_list, m);
    resolve(ucp, "ucp_get_version", f.get_version, m);
    resolve(ucp, "ucp_config_read", f.config_read, m);
    resolve(ucp, "ucp_config_modify", f.config_modify, m);
    resolve(ucp, "ucp_config_release", f.config_release, m);
    resolve(ucp, "ucp_init_version", f.init_version, m);
    resolve(ucp, "ucp_cleanup", f.cleanup, m);
    resolve(ucp, "ucp_context_query", f.context_query, m);
    resolve(ucp, "ucp_context_print_info", f.context_print_info, m);
    resolve(ucp, "ucp_worker_create", f.worker_create, m);
    resolve(ucp, "ucp_worker_destroy", f.worker_destroy, m);
    resolve(ucp, "ucp_worker_query", f.worker_query, m);
    resolve(ucp, "ucp_worker_release_address", f.worker_release_address, m);
    resolve(ucp, "ucp_worker_progress", f.worker_progress, m);
    resolve(ucp, "ucp_worker_get_efd", f.worker_get_efd, m);
    resolve(ucp, "ucp_worker_arm", f.worker_arm, m);
    resolve(ucp, "ucp_worker_set_am_recv_handler", f.worker_set_am_recv_handler, m);
    resolve(ucp, "ucp_ep_create", f.ep_create, m);
    resolve(ucp, "ucp_ep_close_nbx", f.ep_close_nbx, m);
    resolve(ucp, "ucp_ep_flush_nbx", f.ep_flush_nbx, m);
    resolve(ucp, "ucp_ep_print_info", f.ep_print_info, m);
    resolve(ucp, "ucp_mem_map", f.mem_map, m);
    resolve(ucp, "ucp_mem_unmap", f.mem_unmap, m);
    resolve(ucp, "ucp_rkey_pack", f.rkey_pack, m);
    resolve(ucp, "ucp_rkey_buffer_release", f.rkey_buffer_release, m);
    resolve(ucp, "ucp_ep_rkey_unpack", f.ep_rkey_unpack, m);
    resolve(ucp, "ucp_rkey_destroy", f.rkey_destroy, m);
    resolve(ucp, "ucp_put_nbx", f.put_nbx, m);
    resolve(ucp, "ucp_get_nbx", f.get_nbx, m);
    resolve(ucp, "ucp_am_send_nbx", f.am_send_nbx, m);
    resolve(ucp, "ucp_am_recv_data_nbx", f.am_recv_data_nbx, m);
    resolve(ucp, "ucp_am_data_release", f.am_data_release, m);
    resolve(ucp, "ucp_request_check_status", f.request_check_status, m);
    resolve(ucp, "ucp_request_free", f.request_free, m);
    return m;
}

// Opens libucs, libuct and libucp of one folder; "" or why not. Handles are never closed: UCX
// stays loaded for the life of the process.
std::string open_set(const std::string& libucp, void*& ucs, void*& uct, void*& ucp) {
    const std::string dir = folder_of(libucp);
    struct stat st{};
    if (stat(libucp.c_str(), &st) != 0) return "no such file";
    // libucs first, by path: libuct and libucp then find it by its soname instead of searching.
    for (auto [slot, path] : {std::pair<void**, std::string>{&ucs, sibling(dir, "libucs")},
                              {&uct, sibling(dir, "libuct")},
                              {&ucp, libucp}}) {
        *slot = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (*slot == nullptr) {
            const char* e = dlerror();
            return std::string("dlopen failed: ") + (e ? e : "unknown error");
        }
    }
    return "";
}

}  // namespace

UcxError::UcxError(const std::string& what, api::Status status)
    : std::runtime_error("UCX " + what + " failed: " + status_text(status) + " (" + std::to_string(status) + ")"),
      status_(status) {}

const Library& load(const std::vector<Candidate>& candidates) {
    std::lock_guard lk(loadMu);
    if (loadedOk) {
        for (const Candidate& c : candidates)
            if (c.source == "MORI_UCX_LIB" && !same_file(c.libucp, lib.path))
                throw LoadError("MORI_UCX_LIB names " + c.libucp + " but this process has already loaded UCX from " +
                                lib.path + " (" + lib.source + "); a process holds one UCX");
        return lib;
    }
    std::string tried;
    void *ucs = nullptr, *uct = nullptr, *ucp = nullptr;
    // A UCX someone else loaded (another package's bindings, MPI): a second copy in one process
    // would share its global state by soname, so use that one.
    void* present = dlopen("libucp.so.0", RTLD_NOW | RTLD_NOLOAD);
    if (present != nullptr) {
        std::string path = path_of(present);
        for (const Candidate& c : candidates)
            if (c.source == "MORI_UCX_LIB" && !same_file(c.libucp, path))
                throw LoadError("MORI_UCX_LIB names " + c.libucp + " but this process has already loaded UCX from " +
                                path + "; a process holds one UCX");
        ucs = dlopen("libucs.so.0", RTLD_NOW | RTLD_NOLOAD);
        uct = dlopen("libuct.so.0", RTLD_NOW | RTLD_NOLOAD);
        ucp = present;
        if (ucs == nullptr || uct == nullptr)
            throw LoadError("UCX is already loaded in this process (" + path + ") without its libucs/libuct");
        std::string missing = resolve_all(ucs, uct, ucp, table);
        if (!missing.empty()) throw LoadError("the UCX already loaded in this process (" + path + ") lacks " + missing);
        lib.path = path;
        lib.source = "already loaded in this process";
    } else {
        for (const Candidate& c : candidates) {
            std::string why = open_set(c.libucp, ucs, uct, ucp);
            if (why.empty()) {
                api::Functions f{};
                std::string missing = resolve_all(ucs, uct, ucp, f);
                if (missing.empty()) {
                    table = f;
                    lib.path = c.libucp;
                    lib.source = c.source;
                    break;
                }
                why = "lacks " + missing + " (UCX older than 1.13?)";
            }
            tried += "\n  " + c.libucp + " (" + c.source + "): " + why;
            ucp = nullptr;
        }
        if (ucp == nullptr)
            throw LoadError("no usable UCX found" +
                            (tried.empty() ? std::string(" (no candidate)") : "; tried:" + tried) +
                            "\nInstall one: pip install libucx-cu13 (the libucx wheel, no verbs), or your system's UCX "
                            "with verbs (Debian/Ubuntu: apt-get install libucx0 ucx-utils), or set MORI_UCX_LIB to a "
                            "libucp.so or its folder.");
    }
    table.get_version(&lib.major, &lib.minor, &lib.release);
    if (lib.major != 1 || lib.minor < 13)
        throw LoadError("UCX " + std::to_string(lib.major) + "." + std::to_string(lib.minor) + " at " + lib.path +
                        " is too old: mori needs UCX 1.13 or newer");
    loadedOk = true;
    return lib;
}

const Library& library() {
    std::lock_guard lk(loadMu);
    if (!loadedOk) throw LoadError("UCX is not loaded: call mori.core.ucx.load() first");
    return lib;
}

const api::Functions& fn() { return table; }

std::string status_text(api::Status s) {
    const char* t = table.status_string ? table.status_string(s) : nullptr;
    return t ? t : "status " + std::to_string(s);
}

void check(const std::string& what, api::Status s) {
    if (s != api::kOk) throw UcxError(what, s);
}

std::vector<std::pair<std::string, std::vector<std::string>>> components() {
    library();
    api::Component** list = nullptr;
    unsigned count = 0;
    check("uct_query_components", table.query_components(&list, &count));
    std::vector<std::pair<std::string, std::vector<std::string>>> out;
    try {
        for (unsigned i = 0; i < count; ++i) {
            api::ComponentAttr attr{};
            attr.fieldMask = api::kComponentName | api::kComponentMdCount;
            check("uct_component_query", table.component_query(list[i], &attr));
            std::vector<api::MdResource> mds(attr.mdResourceCount);
            if (!mds.empty()) {
                attr.fieldMask = api::kComponentMds;
                attr.mdResources = mds.data();
                check("uct_component_query", table.component_query(list[i], &attr));
            }
            std::vector<std::string> names;
            for (const auto& md : mds) names.emplace_back(md.name, strnlen(md.name, sizeof(md.name)));
            out.emplace_back(std::string(attr.name, strnlen(attr.name, sizeof(attr.name))), std::move(names));
        }
    } catch (...) {
        table.release_component_list(list);
        throw;
    }
    table.release_component_list(list);
    return out;
}

}  // namespace mori::ucx
