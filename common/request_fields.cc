#include "common/request_fields.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>
#include <google/protobuf/unknown_field_set.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace rebound {
namespace {

using google::protobuf::FieldDescriptor;

absl::Status CheckAt(const google::protobuf::Message& message, const std::string& path) {
  const google::protobuf::Reflection* reflection = message.GetReflection();
  const google::protobuf::Descriptor* descriptor = message.GetDescriptor();
  const google::protobuf::UnknownFieldSet& unknown = reflection->GetUnknownFields(message);
  for (int i = 0; i < unknown.field_count(); ++i) {
    const google::protobuf::UnknownField& field = unknown.field(i);
    const FieldDescriptor* known = descriptor->FindFieldByNumber(field.number());
    if (known == nullptr || known->type() != FieldDescriptor::TYPE_ENUM) continue;
    const std::string value = field.type() == google::protobuf::UnknownField::TYPE_VARINT
                                  ? absl::StrCat(static_cast<int64_t>(field.varint()))
                                  : std::string("(not a varint)");
    return absl::InvalidArgumentError(absl::StrCat(path, known->name(), ": unknown enum value ",
                                                   value, " (", known->enum_type()->full_name(),
                                                   ")"));
  }
  std::vector<const FieldDescriptor*> fields;
  reflection->ListFields(message, &fields);
  for (const FieldDescriptor* field : fields) {
    if (field->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE) continue;
    if (field->is_repeated()) {
      const int n = reflection->FieldSize(message, field);
      for (int j = 0; j < n; ++j) {
        const absl::Status status =
            CheckAt(reflection->GetRepeatedMessage(message, field, j),
                    absl::StrCat(path, field->name(), "[", j, "]."));
        if (!status.ok()) return status;
      }
    } else {
      const absl::Status status = CheckAt(reflection->GetMessage(message, field),
                                          absl::StrCat(path, field->name(), "."));
      if (!status.ok()) return status;
    }
  }
  return absl::OkStatus();
}

bool NameCharacter(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
         c == '.' || c == '_' || c == '-' || c == ':' || c == '@' || c == '+';
}

}  // namespace

absl::Status CheckEnumValues(const google::protobuf::Message& message) {
  return CheckAt(message, "");
}

absl::Status ValidateWorkerName(absl::string_view name, absl::string_view field) {
  if (name.empty() || name.size() > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must have 1 to 256 characters, got ", name.size()));
  }
  for (size_t i = 0; i < name.size(); ++i) {
    if (!NameCharacter(name[i])) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s may hold only the characters [A-Za-z0-9._:@+-], got byte 0x%02x at offset %d", field,
          static_cast<unsigned char>(name[i]), i));
    }
  }
  return absl::OkStatus();
}

}  // namespace rebound
