"""What the remote modules share: the edge-case log with its config, and an S3 store on
loopback for a module (its bucket ``BUCKET``, the ``AWS_*`` variables set while it runs)."""

from __future__ import annotations

import os

import pytest
import yaml

from tests.support import edgegen


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    """The edge-case lean log with an action log, and its config file's path."""
    lg = edgegen.make_lean(tmp_path_factory.mktemp("edge"), actions=True)
    cfg = tmp_path_factory.mktemp("cfg") / "config.yaml"
    cfg.write_text(yaml.safe_dump(lg.config))
    return lg, str(cfg)


@pytest.fixture(scope="module")
def s3_store(request, tmp_path_factory):
    """moto's S3 server for the module, with the module's ``BUCKET``; pyarrow, delta-rs and boto3
    in this process reach it through the ``AWS_*`` variables, put back afterwards."""
    from userwise.pipelines.tools.s3_store import S3Store

    s = S3Store(buckets=(request.module.BUCKET,), log=tmp_path_factory.mktemp("s3") / "s3-store.log").start()
    saved = {k: os.environ.get(k) for k in s.env()}
    os.environ.update(s.env())
    yield s
    s.close()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
