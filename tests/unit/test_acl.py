"""Unit tests of the ACL 2.0 requests and refusal handling (no broker, no network).

The expected encodings are written out from RocketMQ 5.3.3's own definitions
(RequestCode AUTH_* = 3001..3010; CreateUserRequestHeader.username with a
UserInfo body; CreateAclRequestHeader.subject with an AclInfo body of
PolicyInfo / PolicyEntryInfo), and the refusal remarks are the broker's
(DefaultAuthenticationHandler, AclAuthorizationHandler), not derived from the
code under test.
"""

from __future__ import annotations

import json

import pytest
from pydantic import SecretStr

from stream_assets.examples import wordcount
from stream_assets.rocketmq import acl
from stream_assets.rocketmq.errors import CredentialsRefusedError, RemotingError, RocketMQError
from stream_assets.rocketmq.remoting import RemotingCommand

SECRET = "pa55-w0rd-never-shown"


def test_create_user_request_is_code_3001_with_username_header_and_userinfo_body() -> None:
    code, fields, body = acl.create_user_request("alice", SecretStr(SECRET))
    assert code == 3001
    assert fields == {"username": "alice"}
    assert json.loads(body) == {
        "username": "alice",
        "password": SECRET,
        "userType": "Normal",
        "userStatus": "enable",
    }


def test_update_user_request_is_code_3002_and_super_users_are_named_super() -> None:
    code, fields, body = acl.create_user_request("root", SecretStr(SECRET), "Super", update=True)
    assert (code, fields) == (3002, {"username": "root"})
    assert json.loads(body)["userType"] == "Super"


def test_create_acl_request_is_code_3006_with_subject_and_one_custom_policy() -> None:
    grants = [
        acl.Grant("Topic:orders", ("Sub", "Get"), why="read"),
        acl.Grant("Group:orders-*", ("Sub",), source_ips=("10.0.0.0/8",)),
        acl.Grant("Topic:secret", ("Pub",), decision="Deny"),
    ]
    code, fields, body = acl.create_acl_request("alice", grants)
    assert code == 3006
    assert fields == {"subject": "User:alice"}
    assert json.loads(body) == {
        "subject": "User:alice",
        "policies": [
            {
                "policyType": "Custom",
                "entries": [
                    {"resource": "Topic:orders", "actions": ["Sub", "Get"], "decision": "Allow"},
                    {
                        "resource": "Group:orders-*",
                        "actions": ["Sub"],
                        "sourceIps": ["10.0.0.0/8"],
                        "decision": "Allow",
                    },
                    {"resource": "Topic:secret", "actions": ["Pub"], "decision": "Deny"},
                ],
            }
        ],
    }


def test_delete_requests() -> None:
    assert acl.delete_user_request("alice") == (3003, {"username": "alice"}, b"")
    assert acl.delete_acl_request("alice") == (3008, {"subject": "User:alice"}, b"")
    assert acl.delete_acl_request("alice", "Topic:orders") == (
        3008,
        {"subject": "User:alice", "policyType": "Custom", "resource": "Topic:orders"},
        b"",
    )


@pytest.mark.parametrize(
    ("resource", "actions"),
    [
        ("orders", ("Sub",)),  # no type
        ("Queue:orders", ("Sub",)),  # unknown type
        ("Topic:", ("Sub",)),  # no name
        ("Topic:orders", ()),  # no action
        ("Topic:orders", ("Any",)),  # the broker refuses Any in grants
        ("Topic:orders", ("sub",)),  # names are the broker's, capitalised
    ],
)
def test_malformed_grants_are_refused_before_sending(
    resource: str, actions: tuple[str, ...]
) -> None:
    with pytest.raises(ValueError, match="ACL"):
        acl.Grant(resource, actions)


def test_bad_user_names_and_empty_passwords_are_refused() -> None:
    for name in ("", "User:x", "a*", "a b", "a,b"):
        with pytest.raises(ValueError, match="user name"):
            acl.create_user_request(name, SecretStr(SECRET))
    with pytest.raises(ValueError, match="password"):
        acl.create_user_request("alice", SecretStr(""))
    with pytest.raises(ValueError, match="no grants"):
        acl.create_acl_request("alice", [])


def test_topology_grants_cover_every_topic_and_group_of_wordcount() -> None:
    topology = wordcount.build("wc", "lines", "counts")
    grants = {g.resource: set(g.actions) for g in acl.topology_grants(topology)}
    assert grants == {
        "Topic:lines": {"Sub", "Get", "Update"},
        "Topic:wc__*": {"Pub", "Sub", "Get", "Update", "Create"},
        "Topic:counts": {"Pub", "Create"},
        "Group:wc": {"Sub", "Get", "Update"},
        "Group:wc-*": {"Sub", "Get", "Update"},
    }
    for topic in (*topology.shuffle_topics, *topology.state_topics, topology.dead_letter_topic):
        assert topic.startswith("wc__")
    without_create = acl.topology_grants(topology, group="wc-prod", create_topics=False)
    assert all("Create" not in g.actions for g in without_create)
    assert {g.resource for g in without_create} >= {"Group:wc-prod", "Group:wc-prod-*"}
    assert all(g.why for g in without_create)


def test_an_exactly_once_sink_may_also_be_read_back() -> None:
    topology = wordcount.build("wc", "lines", "counts", exactly_once=True)
    grants = {g.resource: set(g.actions) for g in acl.topology_grants(topology)}
    assert grants["Topic:counts"] == {"Pub", "Sub", "Get", "Create"}
    assert grants["Topic:TRANS_CHECK_MAX_TIME_TOPIC"] == {"Sub", "Get"}
    plain = wordcount.build("wc", "lines", "counts")
    assert "Topic:TRANS_CHECK_MAX_TIME_TOPIC" not in {
        g.resource for g in acl.topology_grants(plain)
    }


def _reply(code: int, remark: str | None) -> RemotingCommand:
    return RemotingCommand(code=code, opaque=1, flag=1, remark=remark)


@pytest.mark.parametrize(
    "remark",
    [
        "check signature failed.",
        "User:alice is not found.",
        "User:alice is disabled.",
        "username cannot be null.",
        "Authentication failed. Please verify the credentials and try again.",
    ],
)
def test_authentication_refusals_name_user_operation_and_settings(remark: str) -> None:
    with pytest.raises(CredentialsRefusedError) as caught:
        acl.raise_if_refused(_reply(16, remark), "alice", "read queue offsets", "Topic:orders")
    refused = caught.value
    assert isinstance(refused, RocketMQError)
    assert not refused.missing_grant
    text = str(refused)
    for part in (
        "'alice'",
        "read queue offsets",
        "Topic:orders",
        remark,
        "STREAM_ASSETS_ROCKETMQ_ACCESS_KEY",
        "STREAM_ASSETS_ROCKETMQ_SECRET_KEY",
    ):
        assert part in text


def test_a_missing_grant_names_the_resource_the_broker_refused() -> None:
    remark = "User:alice has no permission to access Group:wc from 10.1.2.3, no matched policies."
    with pytest.raises(CredentialsRefusedError) as caught:
        acl.raise_if_refused(_reply(16, remark), "alice", "query offset", "Topic:t / Group:wc")
    assert caught.value.missing_grant
    assert caught.value.resource == "Group:wc"
    assert "an admin must grant it" in str(caught.value)


def test_no_credentials_is_said_plainly() -> None:
    with pytest.raises(CredentialsRefusedError, match="ACCESS_KEY is not set"):
        acl.raise_if_refused(_reply(16, "username cannot be null."), None, "authenticate", "b")


@pytest.mark.parametrize(
    ("code", "remark"),
    [
        (0, None),
        (22, "query not found"),
        (29, "request queueId[2147483647] is illegal"),
        (16, "the broker[10.0.0.1] sending message is forbidden"),  # not ACL: left to callers
        (16, "The user is existed"),
    ],
)
def test_other_answers_are_not_refusals(code: int, remark: str | None) -> None:
    acl.raise_if_refused(_reply(code, remark), "alice", "op", "res")


def test_refusal_and_remoting_messages_never_hold_the_secret() -> None:
    # Every field the messages are made of comes from the key, the operation and the
    # broker's remark; the secret is none of them (docs/acl.md, "no secret anywhere").
    refused = CredentialsRefusedError("alice", "op", "Topic:t", "check signature failed.")
    remoting = RemotingError("offsets of topic 't'", 16, "check signature failed.")
    for exc in (refused, remoting):
        assert SECRET not in str(exc) and SECRET not in repr(exc)
