# The lab for a multi-node Docker Swarm on one machine (scripts/test-swarm.sh), from Debian packages
# on the Debian base (scripts/docker-images.sh builds PYTHON_IMAGE):
#   --target registry   Debian's docker-registry (the Distribution registry), on :5000: the
#                       registry the nodes pull the cluster's images from
#   --target node       Debian's docker.io and iptables: a Docker engine that runs in a container
#                       (vfs storage: overlay2 does not nest) and joins the Swarm as a node
ARG PYTHON_IMAGE=knot/python:3.11-bookworm

FROM ${PYTHON_IMAGE} AS registry
RUN apt-get update -q \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends docker-registry \
 && rm -rf /var/lib/apt/lists/*
# The package's config asks for htpasswd logins; the lab's registry is reached only on its private
# network and the host's loopback, so it takes none: filesystem storage, HTTP on :5000.
RUN printf '%s\n' 'version: 0.1' 'storage:' '  filesystem:' '    rootdirectory: /var/lib/docker-registry' \
      'http:' '  addr: :5000' > /etc/docker/registry/lab.yml
EXPOSE 5000
CMD ["docker-registry", "serve", "/etc/docker/registry/lab.yml"]

FROM ${PYTHON_IMAGE} AS node
RUN apt-get update -q \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends docker.io iptables procps \
 && rm -rf /var/lib/apt/lists/*
VOLUME /var/lib/docker
# REGISTRY: the lab registry's address, trusted over plain HTTP; the engine also listens on :2375
# of the lab network, so the host drives the Swarm with DOCKER_HOST (the lab is a private bridge).
ENV REGISTRY=10.77.0.2:5000
CMD ["sh", "-c", "exec dockerd --storage-driver=vfs --insecure-registry \"$REGISTRY\" -H unix:///var/run/docker.sock -H tcp://0.0.0.0:2375 --tls=false"]
