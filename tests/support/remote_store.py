"""The tests' HDFS: the product's MiniDFSCluster launcher (``pipelines/tools/hdfs_store.py``)."""

from userwise.pipelines.tools.hdfs_store import HdfsStore, StoreError, ensure_jars

__all__ = ["HdfsStore", "StoreError", "ensure_jars"]
