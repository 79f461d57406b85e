"""The image a deploy runs is its content tag's own, built for that tag (handlers/image_provenance.py),
through Custom::DeployedImage against stubbed ECR and SSM (botocore Stubber). The config blob's
download (a presigned S3 URL in AWS) is the one thing replaced: it returns the bytes ECR would serve."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
from botocore.stub import ANY
from handler_helpers import stubbed_clients

from decider_stacks.handlers import build_jobs, codebuild_job, image_provenance

ACCOUNT, REGION = "123456789012", "us-east-1"
SERVICE_TOKEN = f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:ImageStack-Provider"
REPOSITORY = "decider-images"
REPO_URI = f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/{REPOSITORY}"
TAG = "cpu-" + "1f" * 32
PARAMETER = "/decider/decider-cpu/image"
DOWNLOAD = "https://prod-us-east-1-starport-layer-bucket.s3.us-east-1.amazonaws.com/config?sig=1"


def config_blob(label: str | None = TAG, arch: str = "amd64") -> bytes:
    labels = {image_provenance.BUILT_FOR_LABEL: label} if label else {}
    return json.dumps({"architecture": arch, "os": "linux", "config": {"Labels": labels}}).encode()


def digest_of(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def manifest_of(config: bytes) -> str:
    return json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {
                "mediaType": "application/vnd.docker.container.image.v1+json",
                "digest": digest_of(config),
            },
            "layers": [],
        }
    )


GOOD_CONFIG = config_blob()
GOOD_MANIFEST = manifest_of(GOOD_CONFIG)
GOOD_DIGEST = digest_of(GOOD_MANIFEST.encode())


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    jobs = build_jobs.document(
        image_project="ImageBuild",
        repository_name=REPOSITORY,
        repository_uri=REPO_URI,
        images={},
        model_project="ModelStaging",
        model={},
        archive_key="",
    )
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
        build_jobs.ENV: json.dumps(jobs),
    }.items():
        monkeypatch.setenv(name, value)
    served: dict[str, bytes] = {}
    monkeypatch.setattr(image_provenance, "fetch_url", lambda url: served[url])
    clients, stubs = stubbed_clients()
    yield {"clients": clients, "served": served, **stubs}
    for stub in stubs.values():
        stub.assert_no_pending_responses()
        stub.deactivate()


def tag_points_to(aws: dict[str, Any], digest: str) -> None:
    aws["ecr"].add_response(
        "describe_images",
        {"imageDetails": [{"imageDigest": digest, "imageTags": [TAG]}]},
        expected_params={"repositoryName": REPOSITORY, "imageIds": [{"imageTag": TAG}]},
    )


def ecr_serves(aws: dict[str, Any], digest: str, manifest: str, media_type: str | None = None) -> None:
    image = {"imageId": {"imageDigest": digest}, "imageManifest": manifest}
    if media_type:
        image["imageManifestMediaType"] = media_type
    aws["ecr"].add_response(
        "batch_get_image",
        {"images": [image]},
        expected_params={
            "repositoryName": REPOSITORY,
            "imageIds": [{"imageDigest": digest}],
            "acceptedMediaTypes": ANY,
        },
    )


def config_served(aws: dict[str, Any], config_digest: str, blob: bytes) -> None:
    aws["ecr"].add_response(
        "get_download_url_for_layer",
        {"downloadUrl": DOWNLOAD, "layerDigest": config_digest},
        expected_params={"repositoryName": REPOSITORY, "layerDigest": config_digest},
    )
    aws["served"][DOWNLOAD] = blob


def kept(aws: dict[str, Any], digest: str, manifest: str) -> None:
    """protect_image: the keep-<digest> tag goes on after the checks."""
    ecr_serves(aws, digest, manifest)
    aws["ecr"].add_response("put_image", {"image": {"imageId": {"imageDigest": digest}}})


def deployed(digest: str, source: str = "build") -> dict[str, Any]:
    props = {
        "ServiceToken": SERVICE_TOKEN,
        "Kind": "DeployedImage",
        "EndpointName": "decider-cpu",
        "WaitData": json.dumps({"image": f"{REPO_URI}@{digest}"}),
        "ImageTag": TAG,
        "ImageSource": source,
        "DeployedImageParameter": PARAMETER,
    }
    return {"RequestType": "Update", "RequestId": "r-1", "ResourceProperties": props}


def test_the_tag_s_own_image_built_for_it_is_deployed_and_kept(aws):
    tag_points_to(aws, GOOD_DIGEST)
    ecr_serves(aws, GOOD_DIGEST, GOOD_MANIFEST)
    config_served(aws, digest_of(GOOD_CONFIG), GOOD_CONFIG)
    kept(aws, GOOD_DIGEST, GOOD_MANIFEST)
    result = codebuild_job.on_event(deployed(GOOD_DIGEST), clients=aws["clients"])
    assert result["Data"] == {"ImageUri": f"{REPO_URI}@{GOOD_DIGEST}", "Protected": "true"}


def test_a_signal_naming_another_digest_of_the_repository_fails_the_deploy(aws):
    """Anyone holding the handle's presigned URL could signal first; the tag says what was built."""
    other = "sha256:" + "cd" * 32
    tag_points_to(aws, GOOD_DIGEST)
    with pytest.raises(codebuild_job.BuildFailedError, match="only the tag's own image"):
        codebuild_job.on_event(deployed(other), clients=aws["clients"])


def test_a_signal_naming_another_repository_fails_the_deploy(aws):
    event = deployed(GOOD_DIGEST)
    event["ResourceProperties"]["WaitData"] = json.dumps(
        {"image": f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/elsewhere@{GOOD_DIGEST}"}
    )
    with pytest.raises(codebuild_job.BuildFailedError, match="a built image lives in"):
        codebuild_job.on_event(event, clients=aws["clients"])


@pytest.mark.parametrize(
    "blob", [config_blob(label=None), config_blob(label="cpu-other"), config_blob(arch="arm64")]
)
def test_a_tag_pushed_by_hand_is_refused_with_how_to_remove_it(aws, blob):
    manifest = manifest_of(blob)
    digest = digest_of(manifest.encode())
    tag_points_to(aws, digest)
    ecr_serves(aws, digest, manifest)
    config_served(aws, digest_of(blob), blob)
    with pytest.raises(codebuild_job.BuildFailedError, match="batch-delete-image") as refused:
        codebuild_job.on_event(deployed(digest), clients=aws["clients"])
    assert f"imageTag={TAG}" in str(refused.value)  # nothing was tagged keep-: no put_image expected


def test_a_config_that_is_not_the_manifest_s_is_refused(aws):
    tag_points_to(aws, GOOD_DIGEST)
    ecr_serves(aws, GOOD_DIGEST, GOOD_MANIFEST)
    config_served(aws, digest_of(GOOD_CONFIG), config_blob(label="cpu-other"))
    with pytest.raises(codebuild_job.BuildFailedError, match="does not match"):
        codebuild_job.on_event(deployed(GOOD_DIGEST), clients=aws["clients"])


def test_an_index_is_judged_by_its_linux_amd64_image(aws):
    index = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {"digest": "sha256:" + "0a" * 32, "platform": {"os": "linux", "architecture": "arm64"}},
                {"digest": GOOD_DIGEST, "platform": {"os": "linux", "architecture": "amd64"}},
            ],
        }
    )
    index_digest = digest_of(index.encode())
    tag_points_to(aws, index_digest)
    ecr_serves(aws, index_digest, index, "application/vnd.oci.image.index.v1+json")
    ecr_serves(aws, GOOD_DIGEST, GOOD_MANIFEST)
    config_served(aws, digest_of(GOOD_CONFIG), GOOD_CONFIG)
    image_provenance.check_built_image(aws["clients"]["ecr"], REPOSITORY, TAG, index_digest)


def test_a_deleted_tag_fails_the_deploy(aws):
    aws["ecr"].add_client_error("describe_images", "ImageNotFoundException")
    with pytest.raises(codebuild_job.BuildFailedError, match="does not exist"):
        codebuild_job.on_event(deployed(GOOD_DIGEST), clients=aws["clients"])


def _record(aws: dict[str, Any], uri: str) -> None:
    aws["ssm"].add_response(
        "get_parameter",
        {"Parameter": {"Name": PARAMETER, "Value": json.dumps({"image_uri": uri, "source": "pinned"})}},
        expected_params={"Name": PARAMETER},
    )


def test_a_kept_pinned_image_must_be_the_recorded_one(aws):
    pinned = f"999999999999.dkr.ecr.{REGION}.amazonaws.com/ci@{GOOD_DIGEST}"
    _record(aws, pinned)
    event = deployed(GOOD_DIGEST, source="pinned")
    event["ResourceProperties"]["WaitData"] = json.dumps({"image": pinned})
    result = codebuild_job.on_event(event, clients=aws["clients"])
    assert result["Data"] == {"ImageUri": pinned, "Protected": "false"}  # another account's repository
    _record(aws, pinned.replace("ci@", "other@"))
    with pytest.raises(codebuild_job.BuildFailedError, match="pins"):
        codebuild_job.on_event(event, clients=aws["clients"])
