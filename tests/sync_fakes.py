"""Stand-in engines of the weight-sync tests speak the sync's messages (not a test module).

A stand-in keeps the verbs it records or scripts as plain methods, named as `weightsync/endpoints.py` names them
(`native_start`, `begin_weight_update`, `policy_tag`, ...); `SendsToVerbs.send` is its one transport call, as a real
engine handle's: each message (wire/sync_messages.py) runs the verb it stands for, and its answer is typed as a real
engine's would be. A stand-in that lacks a verb fails loudly when a test sends it.
"""

from __future__ import annotations

from typing import Any

from r3operator.wire.sync_messages import (
    AbortNative,
    AbortPacked,
    BeginNative,
    BeginPacked,
    DeviceUUIDs,
    DirectSync,
    EngineBuild,
    FinishNative,
    FinishPacked,
    InitTransfer,
    LoadPacked,
    MappedAttach,
    MappedSync,
    PackedCounts,
    ParameterFingerprints,
    ParameterMetadata,
    PolicyTag,
    Receipts,
    StagedAttach,
    StagedSync,
    SyncMessage,
    UpdateWeights,
    WeightsDigest,
    WorldSize,
)


class SendsToVerbs:
    """`send(message)`: the verb method the message stands for, on this stand-in."""

    def send(self, message: SyncMessage[Any]) -> Any:
        verbs: Any = self
        match message:
            case BeginPacked():
                return verbs.begin_weight_update()
            case LoadPacked(chunk=chunk):
                return verbs.load_packed(chunk)
            case FinishPacked(policy_tag=tag):
                counts = verbs.finish_weight_update(tag)
                return counts if isinstance(counts, PackedCounts) else message.answer([counts])
            case AbortPacked():
                return verbs.abort_weight_update()
            case BeginNative():
                return verbs.native_start(message)
            case FinishNative(policy_tag=tag):
                return verbs.native_finish(tag)
            case AbortNative():
                return verbs.native_abort()
            case InitTransfer(init_info=info):
                return verbs.native_init(info)
            case UpdateWeights(update_info=info):
                return verbs.native_update(info)
            case WorldSize():
                return verbs.native_world_size()
            case ParameterMetadata():
                return verbs.native_parameters()
            case ParameterFingerprints():
                return verbs.native_parameter_fingerprints()
            case DirectSync(update=update, policy_tag=tag):
                return verbs.native_direct_sync(update, tag)
            case StagedAttach(share=share):
                return verbs.native_staged_attach(share)
            case StagedSync(policy_tag=tag):
                return verbs.native_staged_sync(tag)
            case MappedAttach(share=share):
                return verbs.native_mapped_attach(share)
            case MappedSync(number=number, policy_tag=tag, timeout_s=timeout_s):
                return verbs.native_mapped_sync(number, tag, timeout_s)
            case PolicyTag():
                return verbs.policy_tag()
            case Receipts():
                return verbs.sync_receipts()
            case DeviceUUIDs():
                return verbs.device_uuids()
            case WeightsDigest():
                return verbs.weights_digest()
            case EngineBuild():
                return verbs.engine_build()
        raise NotImplementedError(f"this stand-in takes no {type(message).__name__}")
