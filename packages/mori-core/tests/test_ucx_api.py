"""csrc/ucx/api.hpp (our declaration of the part of UCX's C API the engine calls) against UCX's own
headers, those the libucx wheel ships: every structure offset and constant the engine uses is
compared at compile time, so a layout change in UCX fails here, not in a transfer."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from _ucx_procs import wheel_ucx

CSRC = Path(__file__).resolve().parents[1] / "csrc"

CHECKS = r"""
#include <ucp/api/ucp.h>
#include <uct/api/uct.h>
#include <cstddef>
#include "ucx/api.hpp"
namespace a = mori::ucx::api;
#define SAME_OFFSET(ours, field, theirs, tfield) \
    static_assert(offsetof(a::ours, field) == offsetof(theirs, tfield), #ours "." #field);
#define SAME(ours, theirs) static_assert(static_cast<long long>(ours) == static_cast<long long>(theirs), #ours);
SAME_OFFSET(Params, fieldMask, ucp_params_t, field_mask)
SAME_OFFSET(Params, features, ucp_params_t, features)
SAME_OFFSET(Params, mtWorkersShared, ucp_params_t, mt_workers_shared)
SAME_OFFSET(Params, estimatedNumEps, ucp_params_t, estimated_num_eps)
SAME_OFFSET(Params, name, ucp_params_t, name)
SAME_OFFSET(WorkerParams, threadMode, ucp_worker_params_t, thread_mode)
SAME_OFFSET(WorkerParams, events, ucp_worker_params_t, events)
SAME_OFFSET(WorkerParams, userData, ucp_worker_params_t, user_data)
SAME_OFFSET(WorkerParams, eventFd, ucp_worker_params_t, event_fd)
SAME_OFFSET(WorkerParams, flags, ucp_worker_params_t, flags)
SAME_OFFSET(WorkerParams, name, ucp_worker_params_t, name)
SAME_OFFSET(WorkerAttr, address, ucp_worker_attr_t, address)
SAME_OFFSET(WorkerAttr, addressLength, ucp_worker_attr_t, address_length)
SAME_OFFSET(WorkerAttr, maxAmHeader, ucp_worker_attr_t, max_am_header)
SAME_OFFSET(ContextAttr, memoryTypes, ucp_context_attr_t, memory_types)
SAME_OFFSET(EpParams, address, ucp_ep_params_t, address)
SAME_OFFSET(EpParams, errMode, ucp_ep_params_t, err_mode)
SAME_OFFSET(EpParams, errHandler, ucp_ep_params_t, err_handler.cb)
SAME_OFFSET(EpParams, errArg, ucp_ep_params_t, err_handler.arg)
SAME_OFFSET(EpParams, userData, ucp_ep_params_t, user_data)
SAME_OFFSET(EpParams, flags, ucp_ep_params_t, flags)
SAME_OFFSET(EpParams, name, ucp_ep_params_t, name)
SAME_OFFSET(MemMapParams, address, ucp_mem_map_params_t, address)
SAME_OFFSET(MemMapParams, length, ucp_mem_map_params_t, length)
SAME_OFFSET(MemMapParams, memoryType, ucp_mem_map_params_t, memory_type)
SAME_OFFSET(RequestParam, flags, ucp_request_param_t, flags)
SAME_OFFSET(RequestParam, cb, ucp_request_param_t, cb)
SAME_OFFSET(RequestParam, datatype, ucp_request_param_t, datatype)
SAME_OFFSET(RequestParam, userData, ucp_request_param_t, user_data)
SAME_OFFSET(RequestParam, memoryType, ucp_request_param_t, memory_type)
SAME_OFFSET(RequestParam, memh, ucp_request_param_t, memh)
SAME_OFFSET(AmHandlerParam, id, ucp_am_handler_param_t, id)
SAME_OFFSET(AmHandlerParam, flags, ucp_am_handler_param_t, flags)
SAME_OFFSET(AmHandlerParam, cb, ucp_am_handler_param_t, cb)
SAME_OFFSET(AmHandlerParam, arg, ucp_am_handler_param_t, arg)
SAME_OFFSET(AmRecvParam, replyEp, ucp_am_recv_param_t, reply_ep)
SAME_OFFSET(Iov, length, ucp_dt_iov_t, length)
SAME_OFFSET(ComponentAttr, name, uct_component_attr_t, name)
SAME_OFFSET(ComponentAttr, mdResourceCount, uct_component_attr_t, md_resource_count)
SAME_OFFSET(ComponentAttr, mdResources, uct_component_attr_t, md_resources)
static_assert(sizeof(a::Params) >= sizeof(ucp_params_t) && sizeof(a::WorkerParams) >= sizeof(ucp_worker_params_t) &&
              sizeof(a::EpParams) >= sizeof(ucp_ep_params_t) && sizeof(a::MemMapParams) >= sizeof(ucp_mem_map_params_t) &&
              sizeof(a::RequestParam) >= sizeof(ucp_request_param_t) &&
              sizeof(a::WorkerAttr) >= sizeof(ucp_worker_attr_t) && sizeof(a::ContextAttr) >= sizeof(ucp_context_attr_t) &&
              sizeof(a::MdResource) == sizeof(uct_md_resource_desc_t) && sizeof(a::Status) == sizeof(ucs_status_t),
              "sizes");
SAME(a::kOk, UCS_OK) SAME(a::kInProgress, UCS_INPROGRESS) SAME(a::kErrBusy, UCS_ERR_BUSY)
SAME(a::kErrCanceled, UCS_ERR_CANCELED) SAME(a::kErrLast, UCS_ERR_LAST)
SAME(a::kParamFeatures, UCP_PARAM_FIELD_FEATURES) SAME(a::kParamMtWorkersShared, UCP_PARAM_FIELD_MT_WORKERS_SHARED)
SAME(a::kParamEstimatedEps, UCP_PARAM_FIELD_ESTIMATED_NUM_EPS) SAME(a::kParamName, UCP_PARAM_FIELD_NAME)
SAME(a::kFeatureRma, UCP_FEATURE_RMA) SAME(a::kFeatureAmo64, UCP_FEATURE_AMO64) SAME(a::kFeatureWakeup, UCP_FEATURE_WAKEUP)
SAME(a::kFeatureAm, UCP_FEATURE_AM)
SAME(a::kWorkerParamThreadMode, UCP_WORKER_PARAM_FIELD_THREAD_MODE) SAME(a::kWorkerParamEvents, UCP_WORKER_PARAM_FIELD_EVENTS)
SAME(a::kWorkerParamName, UCP_WORKER_PARAM_FIELD_NAME) SAME(a::kThreadModeSerialized, UCS_THREAD_MODE_SERIALIZED)
SAME(a::kWakeupRma, UCP_WAKEUP_RMA) SAME(a::kWakeupAmo, UCP_WAKEUP_AMO) SAME(a::kWakeupTx, UCP_WAKEUP_TX)
SAME(a::kWakeupRx, UCP_WAKEUP_RX)
SAME(a::kWorkerAttrAddress, UCP_WORKER_ATTR_FIELD_ADDRESS) SAME(a::kWorkerAttrMaxAmHeader, UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER)
SAME(a::kAttrMemoryTypes, UCP_ATTR_FIELD_MEMORY_TYPES)
SAME(a::kEpParamRemoteAddress, UCP_EP_PARAM_FIELD_REMOTE_ADDRESS) SAME(a::kEpParamErrMode, UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE)
SAME(a::kEpParamErrHandler, UCP_EP_PARAM_FIELD_ERR_HANDLER) SAME(a::kEpParamUserData, UCP_EP_PARAM_FIELD_USER_DATA)
SAME(a::kEpParamName, UCP_EP_PARAM_FIELD_NAME) SAME(a::kErrModeNone, UCP_ERR_HANDLING_MODE_NONE)
SAME(a::kErrModePeer, UCP_ERR_HANDLING_MODE_PEER) SAME(a::kEpCloseForce, UCP_EP_CLOSE_FLAG_FORCE)
SAME(a::kMemMapAddress, UCP_MEM_MAP_PARAM_FIELD_ADDRESS) SAME(a::kMemMapLength, UCP_MEM_MAP_PARAM_FIELD_LENGTH)
SAME(a::kMemMapMemoryType, UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE)
SAME(a::kMemoryHost, UCS_MEMORY_TYPE_HOST) SAME(a::kMemoryCuda, UCS_MEMORY_TYPE_CUDA)
SAME(a::kOpCallback, UCP_OP_ATTR_FIELD_CALLBACK) SAME(a::kOpUserData, UCP_OP_ATTR_FIELD_USER_DATA)
SAME(a::kOpDatatype, UCP_OP_ATTR_FIELD_DATATYPE) SAME(a::kOpFlags, UCP_OP_ATTR_FIELD_FLAGS)
SAME(a::kOpMemoryType, UCP_OP_ATTR_FIELD_MEMORY_TYPE) SAME(a::kOpMemh, UCP_OP_ATTR_FIELD_MEMH)
SAME(a::kAmSendReply, UCP_AM_SEND_FLAG_REPLY) SAME(a::kAmSendEager, UCP_AM_SEND_FLAG_EAGER)
SAME(a::kAmSendRndv, UCP_AM_SEND_FLAG_RNDV)
SAME(a::kAmRecvReplyEp, UCP_AM_RECV_ATTR_FIELD_REPLY_EP) SAME(a::kAmRecvData, UCP_AM_RECV_ATTR_FLAG_DATA)
SAME(a::kAmRecvRndv, UCP_AM_RECV_ATTR_FLAG_RNDV)
SAME(a::kAmHandlerId, UCP_AM_HANDLER_PARAM_FIELD_ID) SAME(a::kAmHandlerFlags, UCP_AM_HANDLER_PARAM_FIELD_FLAGS)
SAME(a::kAmHandlerCb, UCP_AM_HANDLER_PARAM_FIELD_CB) SAME(a::kAmHandlerArg, UCP_AM_HANDLER_PARAM_FIELD_ARG)
SAME(a::kAmFlagWholeMsg, UCP_AM_FLAG_WHOLE_MSG)
SAME(a::kDatatypeBytes, ucp_dt_make_contig(1)) SAME(a::kDatatypeIov, ucp_dt_make_iov())
SAME(a::kComponentName, UCT_COMPONENT_ATTR_FIELD_NAME) SAME(a::kComponentMdCount, UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT)
SAME(a::kComponentMds, UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES)
SAME(a::kComponentNameMax, UCT_COMPONENT_NAME_MAX) SAME(a::kMdNameMax, UCT_MD_NAME_MAX)
int main() { return 0; }
"""


def test_our_ucx_declarations_match_the_wheels_headers(tmp_path: Path) -> None:
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    assert cxx, "a C++ compiler is needed (ci/setup.sh installs g++)"
    include = Path(wheel_ucx()).parent / "include"
    assert (include / "ucp" / "api" / "ucp.h").exists(), include
    src = tmp_path / "check.cpp"
    src.write_text(CHECKS)
    proc = subprocess.run(
        [cxx, "-std=c++17", "-fsyntax-only", f"-I{include}", f"-I{CSRC}", str(src)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
