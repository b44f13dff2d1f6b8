// The part of UCX's C API (libucp, libucs, libuct) that mori's UCX engine uses, declared by us
// from UCX's documented API so that mori-core builds with no UCX present: the libraries are
// opened at run time (ucx/lib.cpp) and called through the function table below.
//
// UCX keeps this ABI stable across 1.x through field masks: a parameter structure is only read
// where its field_mask says so, and fields are only ever added at the end. The layouts below are
// those of UCX 1.13 (Debian 12's libucx0) to 1.22 (PyPI's libucx), sized to the larger version;
// tests/test_ucx_api.py compiles every offset and constant used here against the headers that
// the libucx wheel ships and compares.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>

namespace mori::ucx::api {

// ---- handles (opaque) ------------------------------------------------------------------------
struct Context;
struct Worker;
struct Endpoint;
struct MemHandle;
struct RemoteKey;
struct Config;
struct Address;
struct Component;

using Status = int8_t;    // ucs_status_t: a packed enum, one signed byte
using StatusPtr = void*;  // ucs_status_ptr_t: NULL done, an error code, or a request
using Datatype = uint64_t;

constexpr Status kOk = 0;
constexpr Status kInProgress = 1;
constexpr Status kErrBusy = -15;
constexpr Status kErrCanceled = -16;
constexpr Status kErrLast = -100;

inline bool is_error_ptr(StatusPtr p) {
    return reinterpret_cast<uintptr_t>(p) >= static_cast<uintptr_t>(static_cast<intptr_t>(kErrLast));
}
inline Status ptr_status(StatusPtr p) {
    if (p == nullptr) return kOk;
    return is_error_ptr(p) ? static_cast<Status>(reinterpret_cast<intptr_t>(p)) : kInProgress;
}

// ---- constants ---------------------------------------------------------------------------------
// ucp_params_t
constexpr uint64_t kParamFeatures = 1u << 0, kParamMtWorkersShared = 1u << 5, kParamEstimatedEps = 1u << 6,
                   kParamName = 1u << 8;
constexpr uint64_t kFeatureRma = 1u << 1, kFeatureAmo64 = 1u << 3, kFeatureWakeup = 1u << 4, kFeatureAm = 1u << 6;
// ucp_worker_params_t
constexpr uint64_t kWorkerParamThreadMode = 1u << 0, kWorkerParamEvents = 1u << 2, kWorkerParamName = 1u << 6;
constexpr int kThreadModeSerialized = 1;
constexpr unsigned kWakeupRma = 1u << 0, kWakeupAmo = 1u << 1, kWakeupTx = 1u << 10, kWakeupRx = 1u << 11;
// ucp_worker_attr_t
constexpr uint64_t kWorkerAttrAddress = 1u << 1, kWorkerAttrMaxAmHeader = 1u << 3;
// ucp_context_attr_t
constexpr uint64_t kAttrMemoryTypes = 1u << 2;
// ucp_ep_params_t
constexpr uint64_t kEpParamRemoteAddress = 1u << 0, kEpParamErrMode = 1u << 1, kEpParamErrHandler = 1u << 2,
                   kEpParamUserData = 1u << 3, kEpParamName = 1u << 7;
constexpr int kErrModeNone = 0, kErrModePeer = 1;
constexpr uint32_t kEpCloseForce = 1u << 0;
// ucp_mem_map_params_t
constexpr uint64_t kMemMapAddress = 1u << 0, kMemMapLength = 1u << 1, kMemMapMemoryType = 1u << 4;
// ucs_memory_type_t
constexpr int kMemoryHost = 0, kMemoryCuda = 1;
// ucp_request_param_t
constexpr uint32_t kOpCallback = 1u << 1, kOpUserData = 1u << 2, kOpDatatype = 1u << 3, kOpFlags = 1u << 4,
                   kOpMemoryType = 1u << 6, kOpMemh = 1u << 8;
// ucp_am_send_nbx flags (ucp_request_param_t.flags)
constexpr uint32_t kAmSendReply = 1u << 0, kAmSendEager = 1u << 1, kAmSendRndv = 1u << 2;
// ucp_am_recv_param_t.recv_attr
constexpr uint64_t kAmRecvReplyEp = 1u << 0, kAmRecvData = 1u << 16, kAmRecvRndv = 1u << 17;
// ucp_am_handler_param_t
constexpr uint64_t kAmHandlerId = 1u << 0, kAmHandlerFlags = 1u << 1, kAmHandlerCb = 1u << 2, kAmHandlerArg = 1u << 3;
constexpr uint32_t kAmFlagWholeMsg = 1u << 0;
// datatypes: ucp_dt_make_contig(1) and ucp_dt_make_iov()
constexpr Datatype kDatatypeBytes = (1u << 3) | 0, kDatatypeIov = 2;
// uct_component_attr_t
constexpr uint64_t kComponentName = 1u << 0, kComponentMdCount = 1u << 1, kComponentMds = 1u << 2;
constexpr size_t kComponentNameMax = 16, kMdNameMax = 16;

// ---- callbacks ---------------------------------------------------------------------------------
using SendCallback = void (*)(void* request, Status status, void* user);
using RecvDataCallback = void (*)(void* request, Status status, size_t length, void* user);
using ErrorHandler = void (*)(void* arg, Endpoint* ep, Status status);
struct AmRecvParam {
    uint64_t recvAttr;
    Endpoint* replyEp;
};
using AmRecvCallback = Status (*)(void* arg, const void* header, size_t headerLength, void* data, size_t length,
                                  const AmRecvParam* param);

// ---- parameter structures (fields up to the last one mori sets, padded to UCX 1.22's size) ---
struct Params {
    uint64_t fieldMask;
    uint64_t features;
    uint8_t pad0[32];  // request size, init and cleanup callbacks, tag sender mask
    int mtWorkersShared;
    uint8_t pad1[4];
    size_t estimatedNumEps;
    size_t estimatedNumPpn;
    const char* name;
    uint8_t pad2[8];
};
struct WorkerParams {
    uint64_t fieldMask;
    int threadMode;
    uint8_t pad0[132];  // cpu mask
    unsigned events;
    uint8_t pad1[4];
    void* userData;
    int eventFd;
    uint8_t pad2[4];
    uint64_t flags;
    const char* name;
    uint8_t pad3[16];
};
struct WorkerAttr {
    uint64_t fieldMask;
    int threadMode;
    uint32_t addressFlags;
    Address* address;
    size_t addressLength;
    size_t maxAmHeader;
    uint8_t pad[40];
};
struct ContextAttr {
    uint64_t fieldMask;
    size_t requestSize;
    int threadMode;
    uint8_t pad0[4];
    uint64_t memoryTypes;
    uint8_t pad1[40];
};
struct EpParams {
    uint64_t fieldMask;
    const Address* address;
    int errMode;
    uint8_t pad0[4];
    ErrorHandler errHandler;
    void* errArg;
    void* userData;
    uint32_t flags;
    uint8_t pad1[28];  // socket address, connection request
    const char* name;
    uint8_t pad2[16];
};
struct MemMapParams {
    uint64_t fieldMask;
    void* address;
    size_t length;
    unsigned flags;
    unsigned prot;
    int memoryType;
    uint8_t pad[12];
};
struct RequestParam {
    uint32_t opAttrMask;
    uint32_t flags;
    void* request;
    void* cb;  // SendCallback or RecvDataCallback, by operation
    Datatype datatype;
    void* userData;
    void* replyBuffer;
    int memoryType;
    uint8_t pad0[4];
    void* recvInfo;
    MemHandle* memh;
    uint8_t pad1[24];
};
struct AmHandlerParam {
    uint64_t fieldMask;
    unsigned id;
    uint32_t flags;
    AmRecvCallback cb;
    void* arg;
};
struct Iov {
    void* buffer;
    size_t length;
};
struct MdResource {
    char name[kMdNameMax];
};
struct ComponentAttr {
    uint64_t fieldMask;
    char name[kComponentNameMax];
    unsigned mdResourceCount;
    uint8_t pad0[4];
    MdResource* mdResources;
    uint64_t flags;
};

static_assert(sizeof(Params) == 88 && offsetof(Params, mtWorkersShared) == 48 && offsetof(Params, name) == 72);
static_assert(sizeof(WorkerParams) == 200 && offsetof(WorkerParams, events) == 144 &&
              offsetof(WorkerParams, name) == 176);
static_assert(sizeof(EpParams) == 104 && offsetof(EpParams, errHandler) == 24 && offsetof(EpParams, flags) == 48 &&
              offsetof(EpParams, name) == 80);
static_assert(sizeof(MemMapParams) == 48 && offsetof(MemMapParams, memoryType) == 32);
static_assert(sizeof(RequestParam) == 96 && offsetof(RequestParam, memoryType) == 48 &&
              offsetof(RequestParam, memh) == 64);
static_assert(sizeof(AmHandlerParam) == 32 && offsetof(AmHandlerParam, cb) == 16);
static_assert(sizeof(WorkerAttr) == 80 && offsetof(WorkerAttr, maxAmHeader) == 32);
static_assert(sizeof(ContextAttr) == 72 && offsetof(ContextAttr, memoryTypes) == 24);
static_assert(offsetof(ComponentAttr, mdResources) == 32 && sizeof(MdResource) == 16);

// ---- the functions mori calls, resolved with dlsym -------------------------------------------
struct Functions {
    // libucs
    const char* (*status_string)(Status);
    // libuct
    Status (*query_components)(Component***, unsigned*);
    Status (*component_query)(Component*, ComponentAttr*);
    void (*release_component_list)(Component**);
    // libucp
    void (*get_version)(unsigned*, unsigned*, unsigned*);
    Status (*config_read)(const char*, const char*, Config**);
    Status (*config_modify)(Config*, const char*, const char*);
    void (*config_release)(Config*);
    Status (*init_version)(unsigned, unsigned, const Params*, const Config*, Context**);
    void (*cleanup)(Context*);
    Status (*context_query)(Context*, ContextAttr*);
    void (*context_print_info)(const Context*, FILE*);
    Status (*worker_create)(Context*, const WorkerParams*, Worker**);
    void (*worker_destroy)(Worker*);
    Status (*worker_query)(Worker*, WorkerAttr*);
    void (*worker_release_address)(Worker*, Address*);
    unsigned (*worker_progress)(Worker*);
    Status (*worker_get_efd)(Worker*, int*);
    Status (*worker_arm)(Worker*);
    Status (*worker_set_am_recv_handler)(Worker*, const AmHandlerParam*);
    Status (*ep_create)(Worker*, const EpParams*, Endpoint**);
    StatusPtr (*ep_close_nbx)(Endpoint*, const RequestParam*);
    StatusPtr (*ep_flush_nbx)(Endpoint*, const RequestParam*);
    void (*ep_print_info)(Endpoint*, FILE*);
    Status (*mem_map)(Context*, const MemMapParams*, MemHandle**);
    Status (*mem_unmap)(Context*, MemHandle*);
    Status (*rkey_pack)(Context*, MemHandle*, void**, size_t*);
    void (*rkey_buffer_release)(void*);
    Status (*ep_rkey_unpack)(Endpoint*, const void*, RemoteKey**);
    void (*rkey_destroy)(RemoteKey*);
    StatusPtr (*put_nbx)(Endpoint*, const void*, size_t, uint64_t, RemoteKey*, const RequestParam*);
    StatusPtr (*get_nbx)(Endpoint*, void*, size_t, uint64_t, RemoteKey*, const RequestParam*);
    StatusPtr (*am_send_nbx)(Endpoint*, unsigned, const void*, size_t, const void*, size_t, const RequestParam*);
    StatusPtr (*am_recv_data_nbx)(Worker*, void*, void*, size_t, const RequestParam*);
    void (*am_data_release)(Worker*, void*);
    Status (*request_check_status)(void*);
    void (*request_free)(void*);
};

}  // namespace mori::ucx::api
