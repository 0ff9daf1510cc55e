"""The pod and workload mutation (pure functions): what an injected pod looks like."""

from __future__ import annotations

import json
from typing import Any

import jsonpatch
import pytest

from strata.config import StrataConfig
from strata_operator.admission.mutation import (
    InjectionError,
    InjectionSettings,
    build_pod_patch,
    escape_pointer,
    job_id_for,
)
from strata_operator.admission.workloads import build_workload_patch
from strata_operator.api import DEFAULT_HOST_PATH
from strata_operator.constants import (
    INJECTED_ANNOTATION,
    PVC_VOLUME,
    RAM_VOLUME,
    REPORT_CA_ANNOTATION,
    SIDECAR_NAME,
    TMP_VOLUME,
    TOKEN_VOLUME,
)
from tests.fixtures.pods import (
    PodBuilder,
    job_obj,
    jobset_obj,
    policy_obj,
    pytorchjob_obj,
)
from tests.fixtures.pss import restricted_violations

pytestmark = pytest.mark.unit

SETTINGS = InjectionSettings(
    sidecar_image="strata:test",
    report_endpoint="https://127.0.0.1:8444",
    report_ca_pem="-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n",
)


def inject(pod: dict[str, Any], policy: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    ops = build_pod_patch(pod, policy or policy_obj(), kw.pop("settings", SETTINGS), **kw)
    # The admission response is serialised: the patch must be plain JSON.
    ops = json.loads(json.dumps(ops))
    return jsonpatch.apply_patch(pod, ops)  # type: ignore[no-any-return]


def sidecar_of(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["spec"]["initContainers"] if c["name"] == SIDECAR_NAME)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def training_pod() -> PodBuilder:
    return PodBuilder("trainer-0").policy("fast").container("train")


def test_injected_pod_gets_volumes_sidecar_env_mounts_and_grace() -> None:
    pod = inject(training_pod().spec_field("terminationGracePeriodSeconds", 30).obj())
    spec = pod["spec"]
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols[RAM_VOLUME]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert vols[PVC_VOLUME]["persistentVolumeClaim"] == {"claimName": "ckpt"}
    token = vols[TOKEN_VOLUME]["projected"]["sources"]
    assert token[0]["serviceAccountToken"]["audience"] == "strata.dev"
    assert token[0]["serviceAccountToken"]["expirationSeconds"] >= 600
    assert token[1]["downwardAPI"]["items"][0]["path"] == "ca.crt"
    assert pod["metadata"]["annotations"][REPORT_CA_ANNOTATION] == SETTINGS.report_ca_pem
    assert pod["metadata"]["annotations"][INJECTED_ANNOTATION] == "fast"
    assert spec["terminationGracePeriodSeconds"] == 120

    sidecar = sidecar_of(pod)
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["image"] == "strata:test"
    assert sidecar["startupProbe"]["httpGet"]["path"] == "/healthz"
    # tmpfs pages of the pre-faulted slots are charged to the sidecar: limit = RAM + overhead
    assert sidecar["resources"]["limits"]["memory"] == "2304Mi"
    assert sidecar["resources"]["requests"]["memory"] == "2304Mi"
    assert "cpu" not in sidecar["resources"]["limits"]

    train = spec["containers"][0]
    env = env_of(train)
    config = StrataConfig.from_env({"STRATA_CONFIG": env["STRATA_CONFIG"]})
    assert config.job_id == "team-a.trainer-0"
    assert config.policy == "fast"
    assert config.ram.size_limit_bytes == 2 << 30
    assert config.pvc is not None and config.pvc.claim_name == "ckpt"
    assert config.report.endpoint == "https://127.0.0.1:8444"
    assert config.report.ca_path == "/var/run/secrets/strata.dev/ca.crt"
    assert config.termination_grace_seconds == 120
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env_of(sidecar)["STRATA_CONFIG"] == env["STRATA_CONFIG"]
    mounts = {m["name"]: m["mountPath"] for m in train["volumeMounts"]}
    assert mounts == {RAM_VOLUME: config.ram.path, PVC_VOLUME: config.pvc.path}


def test_sidecar_root_filesystem_is_read_only_with_a_writable_tmp() -> None:
    pod = inject(training_pod().obj())
    sidecar = sidecar_of(pod)
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"]: m["name"] for m in sidecar["volumeMounts"]}
    assert mounts["/tmp"] == TMP_VOLUME
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    # Disk-backed (not charged to the sidecar's memory) and bounded.
    assert vols[TMP_VOLUME]["emptyDir"] == {"sizeLimit": "64Mi"}
    # Only the sidecar mounts it: the training containers' /tmp stays theirs.
    for c in pod["spec"]["containers"]:
        assert TMP_VOLUME not in {m["name"] for m in c.get("volumeMounts") or []}
    assert not restricted_violations(inject(training_pod().restricted().obj()))


def test_pod_with_its_own_strata_tmp_volume_is_refused() -> None:
    pod = training_pod().volume(TMP_VOLUME, emptyDir={}).obj()
    with pytest.raises(InjectionError, match="strata-tmp"):
        build_pod_patch(pod, policy_obj(), SETTINGS)


def test_grace_period_is_raised_never_lowered() -> None:
    pod = inject(training_pod().spec_field("terminationGracePeriodSeconds", 600).obj())
    assert pod["spec"]["terminationGracePeriodSeconds"] == 600
    assert (
        StrataConfig.from_env(
            {"STRATA_CONFIG": env_of(pod["spec"]["containers"][0])["STRATA_CONFIG"]}
        ).termination_grace_seconds
        == 600
    )


def test_patch_is_idempotent() -> None:
    pod = inject(training_pod().native_sidecar("proxy").init_container("fetch").obj())
    assert build_pod_patch(pod, policy_obj(), SETTINGS) == []


def test_keeps_existing_init_containers_native_sidecars_env_and_unknown_fields() -> None:
    original = (
        training_pod()
        .init_container("fetch-data", command=["sh", "-c", "true"])
        .native_sidecar("proxy")
        .container("logger", env=[{"name": "LEVEL", "value": "debug"}])
        .volume("data", emptyDir={})
        .spec_field("x-unknown-field", {"kept": True})
        .annotation("team/owner", "alice")
        .obj()
    )
    pod = inject(original)
    names = [c["name"] for c in pod["spec"]["initContainers"]]
    # Appended after the existing ones: starts after the proxy and data staging, stops before them.
    assert names == ["fetch-data", "proxy", SIDECAR_NAME]
    assert pod["spec"]["initContainers"][:2] == original["spec"]["initContainers"]
    assert pod["spec"]["x-unknown-field"] == {"kept": True}
    assert pod["metadata"]["annotations"]["team/owner"] == "alice"
    logger = pod["spec"]["containers"][1]
    assert logger["env"][0] == {"name": "LEVEL", "value": "debug"}
    assert "STRATA_CONFIG" in env_of(logger)
    assert {v["name"] for v in pod["spec"]["volumes"]} >= {"data", RAM_VOLUME}
    # Nothing the pod had is removed or changed (apart from raising the grace period).
    ops = build_pod_patch(original, policy_obj(), SETTINGS)
    assert {op["op"] for op in ops} == {"add"}


def test_user_env_and_mounts_that_collide_with_strata_are_refused() -> None:
    # Issue 15: a user's POD_NAME or a mount at Strata's RAM path used to win silently, so the
    # trainer ran with another identity or RAM tier than the sidecar. Now the pod is refused
    # with what to change, and the user's objects are never rewritten.
    pod = (
        PodBuilder("p")
        .policy("fast")
        .container(
            "train",
            env=[{"name": "POD_NAME", "value": "custom"}],
            volumeMounts=[{"name": "scratch", "mountPath": "/strata/ram"}],
        )
        .volume("scratch", emptyDir={})
        .obj()
    )
    with pytest.raises(InjectionError) as err:
        build_pod_patch(pod, policy_obj(), SETTINGS)
    assert "env POD_NAME" in str(err.value) and "metadata.name" in str(err.value)
    assert "/strata/ram" in str(err.value) and "move that mount" in str(err.value)
    # The same downward-API field the webhook would set is not a conflict: kept as it is.
    same = inject(
        PodBuilder("p")
        .policy("fast")
        .container(
            "train",
            env=[{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        )
        .obj()
    )
    train = same["spec"]["containers"][0]
    assert [e for e in train["env"] if e["name"] == "POD_NAME"] == [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    ]


def test_restricted_pod_stays_restricted() -> None:
    pod = training_pod().container("eval").init_container("fetch").restricted().obj()
    assert restricted_violations(pod) == []
    injected = inject(pod)
    assert restricted_violations(injected) == []
    # Without pod-level runAsUser the sidecar sets its own non-root UID.
    bare = training_pod().obj()
    bare["spec"]["containers"][0]["securityContext"] = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert restricted_violations(bare) == []
    assert restricted_violations(inject(bare)) == []
    assert sidecar_of(inject(bare))["securityContext"]["runAsUser"] == SETTINGS.run_as_user


def test_sidecar_runs_as_the_trainers_uid_so_both_own_the_ram_tier() -> None:
    """The sidecar allocates slot files the trainer writes and prunes the trainer's steps: a
    trainer running as UID 1234 (container-level) gets a sidecar running as 1234 too."""
    pod = training_pod().obj()
    pod["spec"]["containers"][0]["securityContext"] = {"runAsUser": 1234, "runAsGroup": 2345}
    security = sidecar_of(inject(pod))["securityContext"]
    assert (security["runAsUser"], security["runAsGroup"]) == (1234, 2345)
    # A pod-level UID applies to every container, the sidecar included: nothing to set.
    restricted = training_pod().restricted().obj()
    assert "runAsUser" not in sidecar_of(inject(restricted))["securityContext"]


def test_hostpath_medium_is_flagged_by_the_checker() -> None:
    pod = inject(training_pod().restricted().obj(), policy_obj(medium="HostPath"))
    vol = next(v for v in pod["spec"]["volumes"] if v["name"] == RAM_VOLUME)
    assert vol["hostPath"]["path"] == DEFAULT_HOST_PATH
    assert any("hostPath" in p for p in restricted_violations(pod))


def test_host_network_pod_gets_no_container_port() -> None:
    pod = inject(training_pod().spec_field("hostNetwork", True).obj())
    assert "ports" not in sidecar_of(pod)
    assert sidecar_of(pod)["startupProbe"]["httpGet"]["port"] == 9464


@pytest.mark.parametrize(
    ("labels", "expected_env"),
    [
        (
            {
                "jobset.sigs.k8s.io/jobset-name": "llm",
                "jobset.sigs.k8s.io/job-index": "1",
                "jobset.sigs.k8s.io/replicatedjob-name": "workers",
                "batch.kubernetes.io/job-completion-index": "3",
                "batch.kubernetes.io/job-name": "llm-workers-1",
            },
            {"STRATA_JOBSET_JOB_INDEX", "STRATA_JOBSET_REPLICATED_JOB", "STRATA_COMPLETION_INDEX"},
        ),
        (
            {
                "training.kubeflow.org/job-name": "bert",
                "training.kubeflow.org/replica-type": "worker",
                "training.kubeflow.org/replica-index": "2",
            },
            {"STRATA_REPLICA_TYPE", "STRATA_REPLICA_INDEX"},
        ),
        (
            {
                "batch.kubernetes.io/job-name": "pretrain",
                "batch.kubernetes.io/job-completion-index": "0",
            },
            {"STRATA_COMPLETION_INDEX"},
        ),
        ({}, set()),
    ],
)
def test_rank_identity_from_workload_labels(labels: dict[str, str], expected_env: set[str]) -> None:
    builder = training_pod()
    for k, v in labels.items():
        builder.label(k, v)
    pod = inject(builder.obj())
    env = env_of(pod["spec"]["containers"][0])
    rank_env = {k for k in env if k.startswith("STRATA_") and k != "STRATA_CONFIG"}
    assert rank_env == expected_env
    for name in expected_env:
        assert env[name]["fieldRef"]["fieldPath"].startswith("metadata.labels['")


@pytest.mark.parametrize(
    ("builder", "job_id"),
    [
        (
            PodBuilder("x")
            .label("jobset.sigs.k8s.io/jobset-name", "llm")
            .label("job-name", "llm-w-0"),
            "team-a.llm",
        ),
        (PodBuilder("x").label("training.kubeflow.org/job-name", "bert"), "team-a.bert"),
        (PodBuilder("x").label("batch.kubernetes.io/job-name", "pretrain"), "team-a.pretrain"),
        (PodBuilder("x").label("job-name", "old-style"), "team-a.old-style"),
        (PodBuilder(None).generate_name("solo-").owner("Job", "owned"), "team-a.owned"),
        (PodBuilder(None).generate_name("solo-"), "team-a.solo"),
        (
            PodBuilder("x").label("job-name", "j").annotation("strata.dev/run-id", "run-42"),
            "run-42",
        ),
    ],
)
def test_job_id(builder: PodBuilder, job_id: str) -> None:
    assert job_id_for(builder.obj(), "team-a") == job_id


def test_bad_run_id_is_refused_with_its_name() -> None:
    pod = training_pod().annotation("strata.dev/run-id", "../etc").obj()
    with pytest.raises(InjectionError, match=r"strata\.dev/run-id"):
        build_pod_patch(pod, policy_obj(), SETTINGS)


def test_training_container_named_like_the_sidecar_is_refused() -> None:
    pod = PodBuilder("p").policy("fast").container(SIDECAR_NAME).obj()
    with pytest.raises(InjectionError, match="rename it"):
        build_pod_patch(pod, policy_obj(), SETTINGS)


def test_bad_size_in_policy_names_the_field() -> None:
    with pytest.raises(InjectionError, match=r"spec\.tiers\.ram\.sizeLimit"):
        build_pod_patch(training_pod().obj(), policy_obj(ram_size="lots"), SETTINGS)


def test_generated_name_pod_without_annotations_or_volumes() -> None:
    pod = PodBuilder(None).generate_name("w-").policy("fast").container("a").container("b").obj()
    injected = inject(pod, policy_obj(pvc=None, grace=None), namespace="ns1")
    assert [v["name"] for v in injected["spec"]["volumes"]] == [
        RAM_VOLUME,
        TOKEN_VOLUME,
        TMP_VOLUME,
    ]
    for c in injected["spec"]["containers"]:
        assert [m["name"] for m in c["volumeMounts"]] == [RAM_VOLUME]
    assert injected["spec"]["terminationGracePeriodSeconds"] == 30


def test_pvc_sub_path_and_policy_sidecar_resources() -> None:
    policy = policy_obj(sub_path="runs/a", image="strata:custom")
    policy["spec"]["sidecar"]["resources"] = {"requests": {"cpu": "1"}, "limits": {"memory": "1Gi"}}
    pod = inject(training_pod().obj(), policy)
    sidecar = sidecar_of(pod)
    assert sidecar["image"] == "strata:custom"
    assert sidecar["resources"] == {
        "requests": {"cpu": "1", "memory": "3Gi"},
        "limits": {"memory": "3Gi"},
    }
    pvc_mounts = [
        m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == PVC_VOLUME
    ]
    assert pvc_mounts[0]["subPath"] == "runs/a"


def test_without_report_ca_no_annotation_or_ca_file() -> None:
    settings = InjectionSettings()
    pod = inject(training_pod().obj(), settings=settings)
    assert REPORT_CA_ANNOTATION not in pod["metadata"]["annotations"]
    sources = next(v for v in pod["spec"]["volumes"] if v["name"] == TOKEN_VOLUME)["projected"][
        "sources"
    ]
    assert len(sources) == 1


def test_escape_pointer() -> None:
    assert escape_pointer("strata.dev/policy") == "strata.dev~1policy"
    assert escape_pointer("a~b/c") == "a~0b~1c"


@pytest.mark.parametrize(
    ("obj", "template_path"),
    [
        (job_obj("j", policy="fast"), ["spec", "template"]),
        (
            jobset_obj("js", policy="fast"),
            ["spec", "replicatedJobs", 0, "template", "spec", "template"],
        ),
        (
            pytorchjob_obj("pt", policy="fast"),
            ["spec", "pytorchReplicaSpecs", "Worker", "template"],
        ),
        (
            pytorchjob_obj("pt", policy="fast"),
            ["spec", "pytorchReplicaSpecs", "Master", "template"],
        ),
    ],
)
def test_workload_templates_get_the_policy_label(
    obj: dict[str, Any], template_path: list[Any]
) -> None:
    obj["metadata"]["annotations"]["strata.dev/run-id"] = "resume-7"
    patched = jsonpatch.apply_patch(obj, build_workload_patch(obj))
    tmpl = patched
    for key in template_path:
        tmpl = tmpl[key]
    assert tmpl["metadata"]["labels"]["strata.dev/policy"] == "fast"
    assert tmpl["metadata"]["annotations"]["strata.dev/run-id"] == "resume-7"
    assert build_workload_patch(patched) == []


def test_workload_without_annotation_is_untouched_and_existing_labels_kept() -> None:
    assert build_workload_patch(job_obj("j")) == []
    js = jobset_obj("js", policy="fast")
    js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"]["labels"][
        "strata.dev/policy"
    ] = "other"
    assert build_workload_patch(js) == []
    patched = jsonpatch.apply_patch(
        jobset_obj("js", policy="fast"), build_workload_patch(jobset_obj("js", policy="fast"))
    )
    labels = patched["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"][
        "labels"
    ]
    assert labels == {"app": "train", "strata.dev/policy": "fast"}


def test_zero_grace_period_is_kept_and_the_config_stays_valid() -> None:
    policy = policy_obj(grace=None)
    pod = inject(training_pod().spec_field("terminationGracePeriodSeconds", 0).obj(), policy)
    assert pod["spec"]["terminationGracePeriodSeconds"] == 0
    env = env_of(pod["spec"]["containers"][0])
    assert (
        StrataConfig.from_env({"STRATA_CONFIG": env["STRATA_CONFIG"]}).termination_grace_seconds
        == 1
    )


@pytest.mark.parametrize(("pod_grace", "expected"), [(None, 30), (45, 45), (0, 1)])
def test_the_sidecar_and_the_trainer_learn_the_pods_grace_period_as_their_flush_budget(
    pod_grace: int | None, expected: int
) -> None:
    """Without a policy value the pod's own terminationGracePeriodSeconds (30 when unset) is
    the termination flush's budget, for the sidecar and for the trainer's SIGTERM handler."""
    builder = training_pod()
    if pod_grace is not None:
        builder.spec_field("terminationGracePeriodSeconds", pod_grace)
    pod = inject(builder.obj(), policy_obj(grace=None))
    assert pod["spec"].get("terminationGracePeriodSeconds", 30) == (
        pod_grace if pod_grace is not None else 30
    )
    for container in (sidecar_of(pod), pod["spec"]["containers"][0]):
        config = StrataConfig.from_env({"STRATA_CONFIG": env_of(container)["STRATA_CONFIG"]})
        assert config.termination_grace_seconds == expected
