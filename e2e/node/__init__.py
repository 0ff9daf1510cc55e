"""A real Kubernetes node for the e2e tests: containerd, runc, a CNI bridge and a real kubelet
joined to the local control plane (`e2e.node.harness`), and Strata's images built from the
project's Dockerfiles without a container engine (`e2e.node.images`)."""
