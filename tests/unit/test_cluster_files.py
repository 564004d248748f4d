"""cluster/: the container image, ray-up YAML, KubeRay manifests and runtime-env file
agree with pyproject.toml, with each other and with the library."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from trainlab.rayjobs import runtime_env as renv

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "cluster"
MANIFESTS = ["ray-cluster.aws.yaml", "kuberay/raycluster.yaml", "kuberay/rayjob.yaml"]


def _pyproject_requirements() -> dict[str, Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {Requirement(r).name: Requirement(r) for r in project["dependencies"]}


def _dockerfile_args() -> dict[str, str]:
    text = (CLUSTER / "Dockerfile").read_text()
    return dict(re.findall(r"^ARG (\w+)=(\S*)$", text, flags=re.M))


def _ray_pin() -> str:
    (spec,) = _pyproject_requirements()["ray"].specifier
    assert spec.operator == "==", "pyproject pins ray exactly; the image must match it"
    return spec.version


def test_image_ray_and_python_match_pyproject():
    image = _dockerfile_args()["RAY_IMAGE"]
    m = re.fullmatch(r"rayproject/ray:(?P<ray>[\d.]+)-py(?P<py>\d)(?P<minor>\d+)-\w+", image)
    assert m, f"unexpected base image {image}"
    assert m["ray"] == _ray_pin()
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert Version(f"{m['py']}.{m['minor']}") in SpecifierSet(requires)


def test_image_installs_the_lock_then_the_project_without_dependencies():
    """The image is the CUDA lock (hashes required), trainlab on top with --no-deps,
    and the build checks the result equals the lock: no version comes from a range."""
    text = (CLUSTER / "Dockerfile").read_text()
    assert _dockerfile_args()["LOCK"] == "requirements/cuda.txt"
    runs = re.findall(r"^RUN (.+?)(?<!\\)$", text, flags=re.M | re.S)
    installs = [r for r in runs if "pip install" in r]
    assert any("--require-hashes -r ${LOCK}" in r for r in installs), installs
    assert any(re.search(r"pip install [^&]*--no-deps -e \.(\s|$)", r) for r in installs)
    assert any("trainlab.envlock check-lock" in r for r in runs)
    # Nothing pinned by hand beside the lock.
    assert not re.findall(r"\b[A-Za-z][\w\-\[\],]*==[\w.]+", " ".join(installs))


def test_specs_name_the_image_of_the_current_lock():
    """The tag is the CUDA lock's (`make lock` rewrites it): a dependency change
    is a new image, and every spec runs it."""
    from trainlab.envlock import image_tag

    for name in MANIFESTS:
        tags = set(re.findall(r"image: REGISTRY/trainlab:(\S+)", (CLUSTER / name).read_text()))
        assert tags == {image_tag("cuda")}, (name, tags)


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifests_parse_and_pin_the_same_ray(name):
    doc = yaml.safe_load((CLUSTER / name).read_text())
    assert isinstance(doc, dict)
    versions = re.findall(r"rayVersion: \"?([\d.]+)", (CLUSTER / name).read_text())
    assert all(v == _ray_pin() for v in versions)
    if doc.get("kind") in ("RayCluster", "RayJob"):
        spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
        assert spec["rayVersion"] == _ray_pin()
        assert spec["authOptions"]["mode"] == "token"


def test_rayjob_entrypoint_is_the_training_script_with_a_real_recipe():
    job = yaml.safe_load((CLUSTER / "kuberay/rayjob.yaml").read_text())
    argv = shlex.split(job["spec"]["entrypoint"])
    inner = argv[argv.index("--") + 1 :] if "--" in argv else argv
    assert inner[:2] == ["python", "trainers/pretrain.py"]
    assert (REPO / inner[1]).is_file()
    assert (REPO / inner[2]).is_file(), f"recipe {inner[2]} not in the repository"
    assert argv[:3] == ["python", "-m", "trainlab.rayjobs.retry"]


def test_ray_up_head_is_private_and_authenticated():
    doc = yaml.safe_load((CLUSTER / "ray-cluster.aws.yaml").read_text())
    head_cmd = " ".join(doc["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_cmd
    assert "RAY_AUTH_MODE=token" in head_cmd
    assert all("RAY_AUTH_MODE=token" in c for c in doc["worker_start_ray_commands"])
    assert "ray stop" not in head_cmd + " ".join(doc["worker_start_ray_commands"])
    assert doc["available_node_types"][doc["head_node_type"]]["resources"] == {"CPU": 0}


def test_images_are_the_one_image():
    images = set()
    for name in MANIFESTS:
        images |= set(re.findall(r"image: (\S+)", (CLUSTER / name).read_text()))
    assert len(images) == 1, images


def test_runtime_env_file_excludes_what_the_library_excludes():
    env = yaml.safe_load((CLUSTER / "runtime_env.yaml").read_text())
    assert set(env["excludes"]) == set(renv.EXCLUDE_ANYWHERE) | set(renv.EXCLUDE_AT_ROOT)
